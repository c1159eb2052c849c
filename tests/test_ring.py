"""ring-gpt (context parallelism by ring attention): placement, balance, ring attention against
the reference in one process, the collective accounting, the non-causal and placement mutants, and the
property test over generated configs."""


import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from sp_harness.cases.ring import mutants as ring_mutants
from sp_harness.cases.ring.attention import CORRECT, ring_attention
from sp_harness.cases.ring.cases import RING
from sp_harness.cases.ring.mappings import Ring
from sp_harness.cases.ring.placement import (
    attention_work,
    contiguous_order,
    imbalance,
    rank_positions,
    work_of,
    zigzag_order,
)
from sp_harness.cases.ring.strategies import ring_configs
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.shards import chunk_sizes
from sp_harness.config.strategies import adversaries
from sp_harness.judge.expect import expected_verdict
from sp_harness.reference.gpt import attention
from sp_harness.report.result_text import format_result

# ------------------------------------------------------------------ placement and balance

def test_zigzag_is_the_2w_chunk_zigzag_when_it_divides():
    # 16 tokens over 4 ranks: 8 chunks of 2, rank i holds chunks i and 7 - i
    pos = rank_positions(zigzag_order(16, (4, 4, 4, 4)), (4, 4, 4, 4))
    assert [p.tolist() for p in pos] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


@pytest.mark.parametrize("shards", [(4, 4, 2), (4, 3), (1, 1, 1, 0), (0, 3), (5,), (0, 0, 1)])
def test_zigzag_places_every_token_exactly_once_without_padding(shards):
    order = zigzag_order(sum(shards), shards)
    assert sorted(order.tolist()) == list(range(sum(shards)))
    assert [len(p) for p in rank_positions(order, shards)] == list(shards)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world):
    seq_len = 2 * world * 32
    shards = chunk_sizes(seq_len, world)
    assert imbalance(attention_work(seq_len, shards, "zigzag", True)) == 1.0
    contiguous = attention_work(seq_len, shards, "none", True)
    # rank W-1 scores its own diagonal block plus W-1 full blocks: ~ (2W-1) x rank 0's triangle
    assert contiguous[-1] / contiguous[0] == pytest.approx(2 * world - 1, rel=0.05)
    assert imbalance(attention_work(seq_len, shards, "none", False)) == 1.0


def test_zigzag_stays_nearly_balanced_when_seq_len_is_not_a_multiple_of_2w():
    for seq_len in (61, 62, 63, 65):
        assert imbalance(attention_work(seq_len, chunk_sizes(seq_len, 2), "zigzag", True)) < 1.1, seq_len


def _shard_positions(case, config: CheckConfig) -> tuple[torch.Tensor, ...]:
    """Each rank's global positions as the case's sharded factory places them (no process group:
    ring-gpt's factory only records the group)."""
    config = case.resolve(config)
    shards = config.seq_shards or chunk_sizes(config.seq_len, config.tp)
    out = []
    for r in range(config.tp):
        ctx = RankContext(config=config, rank=r, world_size=config.tp, dp_rank=0, tp_rank=r, tp_group=None,
                          dp_group=None, tp_ranks=tuple(range(config.tp)), dp_ranks=(r,), seq_shards=shards,
                          device=torch.device("cpu"))
        layout = case.shard(case.build_reference(config), ctx).input_layout
        out.append(layout.seq_order(config.seq_len, shards)[sum(shards[:r]):sum(shards[:r + 1])])
    return tuple(out)


def test_balance_check_kills_the_unbalanced_placement_mutant():
    config = CheckConfig(case="ring-gpt", world_size=4, seq_len=64)
    assert imbalance(work_of(_shard_positions(RING, config), causal=True)) == 1.0
    work = work_of(_shard_positions(ring_mutants.UNBALANCED, config), causal=True)
    assert imbalance(work) > 6.0, work  # 2W-1 = 7 in the limit; 6.1 at 16 tokens per rank


# ------------------------------------------------------------------ ring attention, one process

def _simulated_ring(qs, ks, vs, positions, *, causal, balancer, impl=CORRECT):
    """Every rank's ring attention in one process: the shift hands rank r the block of the rank
    `step` places before it (what the p2p ring delivers)."""
    world, outs, works = len(qs), [], []
    for r in range(world):
        steps = iter(range(1, world))

        def shift(kv, ring, recv_len, r=r, steps=steps):
            src = (r - next(steps)) % world
            return torch.cat([ks[src], vs[src]], dim=1)

        ring = Ring(rank=r, ranks=tuple(range(world)), group=None, seq_shards=tuple(len(p) for p in positions))
        work: list[int] = []
        sim = type(impl)(**{**impl.__dict__, "shift": shift})
        outs.append(ring_attention(qs[r], ks[r], vs[r], ring=ring, positions=positions, causal=causal,
                                   balancer=balancer, seq_len=sum(map(len, positions)), impl=sim, work=work))
        works.append(sum(work))
    return outs, works


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("shards", "balancer"), [((3, 3), "zigzag"), ((4, 4, 2), "zigzag"), ((1, 1, 1, 0), "zigzag"),
                                                   ((4, 4, 2), "none"), ((0, 5), "zigzag")])
def test_ring_attention_matches_reference_attention_and_its_work(causal, shards, balancer):
    gen = torch.Generator().manual_seed(0)
    seq, a, a_kv, d = sum(shards), 4, 2, 3
    q, k, v = (torch.randn(2, h, seq, d, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (a, a_kv, a_kv))
    order = {"zigzag": zigzag_order, "none": contiguous_order}[balancer](seq, shards)
    positions = rank_positions(order, shards)
    pieces = [[t[:, :, p] for p in positions] for t in (q, k, v)]
    outs, works = _simulated_ring(*pieces, positions, causal=causal, balancer=balancer)
    want = attention(q, k, v, causal=causal)
    got = torch.empty_like(want)
    got[:, :, order] = torch.cat(outs, dim=2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert works == attention_work(seq, shards, balancer, causal)
    # grads through the received copies reach the k/v that made them (autograd, one process)
    gw = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    g_got = torch.autograd.grad((got * gw).sum(), (q, k, v))
    g_want = torch.autograd.grad((want * gw).sum(), (q, k, v))
    for x, y in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_empty_rows_and_blocks_carry_no_nan_grad():
    # rank 0 holds nothing; rank 1's first query sees only itself: skipped blocks, lse -inf rows
    positions = (torch.zeros(0, dtype=torch.long), torch.arange(3))
    q = [torch.randn(1, 1, len(p), 2, dtype=torch.float64, requires_grad=True) for p in positions]
    k = [torch.randn(1, 1, len(p), 2, dtype=torch.float64, requires_grad=True) for p in positions]
    v = [torch.randn(1, 1, len(p), 2, dtype=torch.float64, requires_grad=True) for p in positions]
    outs, _ = _simulated_ring(q, k, v, positions, causal=True, balancer="none")
    sum(o.sum() for o in outs).backward()
    assert all(torch.isfinite(t.grad).all() for t in q + k + v)
    assert q[0].grad.numel() == 0


# ------------------------------------------------------------------ on real ranks

@pytest.mark.parametrize(("world", "dp"), [(2, 1), pytest.param(3, 1, marks=pytest.mark.exhaustive(
    "the fast tier runs a ring of 2, and of 2 under dp 2 at 4 ranks")), (4, 2)])
def test_ring_sends_w_minus_1_blocks_per_layer_each_way(sp_check, world, dp):
    res = sp_check(CheckConfig(case="ring-gpt", world_size=world, dp=dp, steps=1))
    assert res.verdict == "PASS", res.reason
    cp, layers = world // dp, RING.resolve(res.config).num_layers
    rows = {(r.phase, r.kind, r.group): r.count for r in res.comm}
    for phase in ("forward", "backward"):
        for kind in ("send", "recv"):
            # forward: W-1 k/v shifts per layer; backward: each shift's grad goes back once
            assert rows.get((phase, kind, "tp"), 0) == layers * (cp - 1), (phase, kind, rows)
    # grad sync: one coalesced SUM over CP, one coalesced average over DP
    assert rows.get(("grad_sync", "all_reduce", "tp"), 0) == 1
    assert rows.get(("grad_sync", "all_reduce", "dp"), 0) == (1 if dp > 1 else 0)
    assert sum(n for (p, k, g), n in rows.items() if k not in ("send", "recv", "all_reduce")) == 0


@pytest.mark.exhaustive("the fast tier kills mutant-ring-balancer-assumes-causal at the forward in test_mutants "
                        "(its pinned entry, noncausal: these 3 ranks and 10 tokens, ring-gpt passing them); the "
                        "PASS where attention is causal is the next test")
def test_causal_under_balancer_mutant_is_killed_non_causal_only(sp_check):
    fields = dict(world_size=3, seq_len=10, causal=False, steps=1)
    assert sp_check(CheckConfig(case="ring-gpt", **fields)).verdict == "PASS"
    res = sp_check(CheckConfig(case=ring_mutants.CAUSAL_UNDER_BALANCER.name, **fields))
    assert res.verdict == "FAIL" and res.first_check == "forward", format_result(res)


def test_causal_under_balancer_mutant_is_right_where_attention_is_causal(sp_check):
    # it is right wherever attention is causal anyway: only a non-causal run can see it
    causal = sp_check(CheckConfig(case=ring_mutants.CAUSAL_UNDER_BALANCER.name, world_size=3, seq_len=10, steps=1))
    assert causal.verdict == "PASS", format_result(causal)


def test_ranks_with_no_target_tokens_count_in_the_loss_normalisation(sp_check):
    # a 4-token prompt over 8 tokens on 4 contiguous ranks: ranks 0 and 1 hold only ignored targets
    fields = dict(world_size=4, seq_len=8, prompt_len=4, load_balancer="none", steps=1)
    assert sp_check(CheckConfig(case="ring-gpt", **fields)).verdict == "PASS"
    res = sp_check(CheckConfig(case=ring_mutants.PER_RANK_LOSS_NORM.name, **fields))  # Megatron-LM PR #7498
    assert res.verdict == "FAIL" and res.first_check == "loss", format_result(res)


def test_a_one_key_bf16_ring_passes_its_structurally_zero_key_bias_grad(sp_check):
    # one key: softmax's p = 1 and the k-bias grad is 0 in exact arithmetic; the ring rounds each
    # block's dO to bf16 for its dP matmul while its row sum D reads the float32 one, so its grad
    # is u |dO| . |v| however much dO . v cancels (1.75x its max-abs bound before the perturbed
    # reference modelled that rounding: docs/false-alarms.md)
    config = CheckConfig(case="ring-gpt", world_size=1, seq_len=1, batch=1, dtype="bfloat16", steps=1, seed=1,
                         hidden=4, ffn=1, num_heads=1, num_kv_heads=1, causal=False, num_layers=1, vocab=12,
                         norm="rmsnorm", adversary="reorder-tf32")
    res = sp_check(config)
    assert res.verdict == "PASS", format_result(res)


def test_a_one_token_gqa_bf16_ring_passes_its_structurally_zero_key_weight_grad(sp_check):
    # one token on rank 0 of 3, four query heads on one kv head of dim 1: the k-proj weight grad
    # is 0 in exact arithmetic. The run's is 5.8e-4 where the perturbed reference's one draw erred
    # 1.1e-5 and the 'rounded' member (a flash-style row sum from the rounded output) 8.6e-5; the
    # max-abs bound counted alt only and FAILed it at 3.29x (the fourteenth session's device
    # campaign, on every kernel family). The members count too: 0.43.
    config = CheckConfig(case="ring-gpt", world_size=3, batch=1, dtype="bfloat16", steps=1, seed=365, hidden=4,
                         ffn=5, num_kv_heads=1, load_balancer="none", vocab=5, norm="rmsnorm", seq_shards=(1, 0, 0),
                         adversary="reorder")
    res = sp_check(config)
    assert res.verdict == "PASS", format_result(res)


def test_prompt_targets_carry_no_loss():
    from sp_harness.cases.common import IGNORE_INDEX, gpt_batch, gpt_tokens

    config = CheckConfig(case="ring-gpt", seq_len=6, prompt_len=4, batch=2, vocab=7)
    tokens, targets = gpt_batch(RING.resolve(config), 0, torch.Generator().manual_seed(0))
    assert (targets[:, :4] == IGNORE_INDEX).all() and (targets[:, 4:] != IGNORE_INDEX).all()
    assert torch.equal(targets[:, 4:5], tokens[:, 5:6])  # still the next token
    assert gpt_tokens(targets) == 4  # 2 sequences x 2 targets that count


def test_unbalanced_placement_mutant_is_numerically_correct(sp_check):
    res = sp_check(CheckConfig(case=ring_mutants.UNBALANCED.name, world_size=2, steps=1))
    assert res.verdict == "PASS", format_result(res)


@given(data=st.data())
def test_ring_configs_get_their_expected_verdict(sp_check, sp_max_world_size, data):
    config = data.draw(ring_configs(max_world_size=sp_max_world_size, adversary_choices=adversaries(include_off=True)),
                       label="config")
    res = sp_check(config)
    want = expected_verdict(config)
    note(format_result(res))
    assert res.verdict == want, f"expected {want}, got {res.verdict}: {res.reason}\nrepro: {res.config.repro()}"


def test_ring_configs_validates_its_bounds():
    with pytest.raises(ValueError, match="max_tokens"):
        ring_configs(max_tokens=0)
    with pytest.raises(ValueError, match="min_world_size"):
        ring_configs(min_world_size=3, max_world_size=2)


# ------------------------------------------------------------------ the engine's Layout.seq_order

def _ctx(rank: int, shards: tuple[int, ...]) -> RankContext:
    config = CheckConfig(case="ring-gpt", world_size=len(shards), seq_len=sum(shards))
    return RankContext(config=config, rank=rank, world_size=len(shards), dp_rank=0, tp_rank=rank, tp_group=None,
                       dp_group=None, tp_ranks=tuple(range(len(shards))), dp_ranks=(rank,), seq_shards=shards,
                       device=torch.device("cpu"))


def test_cut_applies_seq_order_before_the_contiguous_cut():
    from sp_harness.config.case import Layout
    from sp_harness.step.inputs import cut, seq_index

    shards, x = (3, 3), torch.arange(24).view(2, 6, 2)  # (B, S, H)
    layout = Layout(seq_dim=1, batch_dim=0, seq_order=zigzag_order)
    for r, want in enumerate(([0, 1, 5], [2, 3, 4])):  # fronts of 2, backs of 1
        piece, offset = cut(x, layout, _ctx(r, shards))
        assert torch.equal(piece, x[:, want]) and offset == (0, 0, 0)
        assert seq_index(layout, 6, shards, r).tolist() == want
    # no seq_order: the contiguous cut and its offset, as before
    piece, offset = cut(x, Layout(seq_dim=1, batch_dim=0), _ctx(1, shards))
    assert torch.equal(piece, x[:, 3:]) and offset == (0, 3, 0)
    with pytest.raises(ValueError, match="not a permutation"):
        cut(x, Layout(seq_dim=1, seq_order=lambda n, s: torch.zeros(n, dtype=torch.long)), _ctx(0, shards))


def test_localisation_lines_up_permuted_pieces():
    from sp_harness.compare.divergence import _line_up

    ref, index = torch.randn(2, 6, 4), torch.tensor([1, 2, 3])
    line_up = _line_up(ref[:, index], ref, 6, (3, 3), 1, index)
    assert torch.equal(line_up(ref), ref[:, index])
    assert torch.equal(_line_up(ref[:, 3:], ref, 6, (3, 3), 1)(ref), ref[:, 3:])


def test_load_balance_check_passes_zigzag_and_fails_the_unbalanced_mutant(sp_pool):
    from sp_harness.checks import get_check, run_check

    check = get_check("load-balance")
    good = run_check(check, CheckConfig(case="ring-gpt", world_size=4, seq_len=16), runner=sp_pool)
    assert good.status == "pass" and good.figures.ratio == 1.0, good.detail
    # measured on the ranks: every layer's attention reported, and what it reported is the
    # placement's count (2 layers, 4 tokens per rank: 2 x 34 pairs under zigzag)
    assert all(r.num_meters == 2 for r in good.figures.ranks), good.figures
    assert good.figures.work == tuple(2 * w for w in attention_work(16, (4, 4, 4, 4), "zigzag", True))
    bad = run_check(check, CheckConfig(case=ring_mutants.UNBALANCED.name, world_size=4, seq_len=16), runner=sp_pool)
    assert bad.status == "fail" and bad.caught_by == "load balance", bad.detail
    assert bad.figures.ratio > 4.0, bad.detail  # 4 tokens per rank: 10 vs 58 pairs per layer
    # where the claim does not hold exactly, or nothing is claimed: n/a, not a guess
    for fields in (dict(seq_len=10), dict(seq_len=16, load_balancer="none"), dict(seq_len=16, causal=False)):
        assert run_check(check, CheckConfig(case="ring-gpt", world_size=4, **fields), runner=sp_pool).status == "n/a"
    assert run_check(check, CheckConfig(case="megatron-gpt-sp", world_size=2), runner=sp_pool).status == "n/a"
