"""usp-gpt (Ulysses x ring hybrid): the placement, exact collective accounting per step, the
done-when world sizes, declared UNSUPPORTED configs, and generated configs each reaching their
expected verdict."""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from sp_harness.cases.ring.placement import imbalance, rank_positions, work_of, zigzag_order
from sp_harness.cases.ulysses.mappings import kv_heads, query_heads
from sp_harness.cases.usp.cases import default_ring_degree
from sp_harness.cases.usp.placement import group_sizes, usp_order
from sp_harness.cases.usp.strategies import usp_configs
from sp_harness.config.case import Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.config.shards import chunk_sizes
from sp_harness.judge.expect import expected_verdict
from sp_harness.report.result_text import format_result

CASE = "usp-gpt"
TIMEOUT = 180.0  # a shared 2-core machine: no wall-clock claim, only room to finish


def _resolved(**fields) -> CheckConfig:
    return get_case(CASE).resolve(CheckConfig(case=CASE, timeout_s=TIMEOUT, **fields))


# ------------------------------------------------------------------ placement

def test_zigzag_is_over_the_ring_then_contiguous_within_each_ulysses_group():
    # 16 tokens, sp 4 = 2 (Ulysses) x 2 (ring): groups of 8, zigzag over 2 ring ranks (4 chunks
    # of 4: group 0 holds chunks 0 and 3), each group's 8 tokens cut 4/4 among its members
    shards = (4, 4, 4, 4)
    pos = rank_positions(usp_order("zigzag", 2)(16, shards), shards)
    assert [p.tolist() for p in pos] == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    # U = 1 is ring-gpt's zigzag, R = 1 the contiguous split
    assert torch.equal(usp_order("zigzag", 4)(16, shards), zigzag_order(16, shards))
    assert torch.equal(usp_order("zigzag", 1)(16, shards), torch.arange(16))
    assert group_sizes((3, 3, 3, 2), 2) == (6, 5)


def test_zigzag_balances_the_groups_causal_work():
    shards = chunk_sizes(64, 4)
    pos = rank_positions(usp_order("zigzag", 2)(64, shards), shards)
    groups = [torch.cat(pos[0:2]), torch.cat(pos[2:4])]  # what each ring rank attends (per head)
    assert imbalance(work_of(tuple(groups), causal=True)) == 1.0
    contiguous = rank_positions(usp_order("none", 2)(64, shards), shards)
    assert imbalance(work_of((torch.cat(contiguous[0:2]), torch.cat(contiguous[2:4])), causal=True)) > 2.5


def test_default_ring_degree():
    assert [default_ring_degree(sp) for sp in (1, 2, 3, 4, 6)] == [1, 2, 1, 2, 2]
    assert _resolved(world_size=4).ring_degree == 2 and _resolved(world_size=3).ring_degree == 1
    assert _resolved(world_size=4, dp=2).ring_degree == 2 and _resolved(world_size=4, ring_degree=4).ring_degree == 4


# ------------------------------------------------------------------ collective accounting

def _label(ranks: tuple[int, ...], sp: int) -> str:
    return "tp" if ranks == tuple(range(sp)) else "ranks" + "-".join(map(str, ranks))


def _expected_rows(config: CheckConfig) -> dict[tuple[str, str, str], tuple[int, int]]:
    """(phase, kind, group) -> (count, bytes) on rank 0 for one step, from the design. Rank 0 is
    (r, u) = (0, 0): Ulysses group SP ranks 0..U-1, ring SP ranks 0, U, 2U, ...
    Per layer over the Ulysses group (U > 1): 4 all-to-alls forward (q, k, v seq->heads, the
    output heads->seq) and their 4 conjugates backward, counted with the bytes rank 0 sends.
    Per layer over the ring (R > 1): R-1 k/v sends forward (step j sends the block received at
    step j-1, first its own group's) and R-1 sends backward (each received block's grad goes
    back), as many recvs; k/v carry rank 0's k/v heads (the grouping lines up at u = 0).
    One coalesced all-reduce of every grad over SP, one over DP."""
    sp, b, L, R = config.tp, config.batch, config.num_layers, config.ring_degree
    U = sp // R
    seq = config.seq_shards or chunk_sizes(config.seq_len, sp)
    groups = group_sizes(tuple(seq), R)  # tokens per ring rank
    d, a, s0, S0 = config.hidden // config.num_heads, config.num_heads, seq[0], groups[0]
    q_for = query_heads(a, U)
    kv_for = kv_heads(q_for, a, config.num_kv_heads)
    h0, kv0, kv_sent = len(q_for[0]), len(kv_for[0]), sum(len(h) for h in kv_for)
    rows = {}
    if U > 1:
        uly = _label(tuple(range(U)), sp)
        fwd = b * d * (a * s0 + 2 * kv_sent * s0 + h0 * S0)  # q, k, v, then y back
        bwd = b * d * (a * s0 + h0 * S0 + 2 * kv0 * S0)  # grad y, then grads of q, k, v
        rows[("forward", "all_to_all", uly)] = (4 * L, 8 * fwd * L)
        rows[("backward", "all_to_all", uly)] = (4 * L, 8 * bwd * L)
    if R > 1:
        ring = _label(tuple(range(0, sp, U)), sp)
        block = b * 2 * kv0 * d * 8  # bytes per token of a k/v block
        fwd = sum(groups[(1 - j) % R] for j in range(1, R)) * block * L
        bwd = sum(groups[(-j) % R] for j in range(1, R)) * block * L
        for kind in ("send", "recv"):
            # a recv is counted with the bytes it receives: the forward receives what backward sends
            rows[("forward", kind, ring)] = ((R - 1) * L, fwd if kind == "send" else bwd)
            rows[("backward", kind, ring)] = ((R - 1) * L, bwd if kind == "send" else fwd)
    params = sum(p.numel() for p in get_case(CASE).build_reference(config).parameters())
    if sp > 1:
        rows[("grad_sync", "all_reduce", "tp")] = (1, 8 * params)
    if config.dp > 1:
        rows[("grad_sync", "all_reduce", "dp")] = (1, 8 * params)
    return rows


@pytest.mark.parametrize("fields", [
    dict(world_size=4),  # 2 x 2, 12 tokens 3/3/3/3
    dict(world_size=4, seq_len=11),  # 2 x 2 uneven 3/3/3/2: groups 6/5
    dict(world_size=4, ring_degree=4, seq_shards=(4, 0, 1, 3)),  # pure ring of 4, an empty rank
    dict(world_size=3, seq_len=10),  # 3 x 1: pure Ulysses, heads 2/1/1
    dict(world_size=4, dp=2, seq_len=7),  # dp 2 x (1 x 2)
], ids=["2x2", "2x2-uneven", "1x4-empty", "3x1", "dp2x1x2"])
def test_collectives_per_step_are_exactly_the_design(sp_check, fields):
    config = _resolved(steps=1, **fields)
    res = sp_check(config)
    assert res.verdict == "PASS", res.reason
    got = {(r.phase, r.kind, r.group): (r.count, r.bytes) for r in res.comm}
    assert got == _expected_rows(config), format_result(res)


# ------------------------------------------------------------------ the done-when sizes

@pytest.mark.parametrize("fields", [
    dict(world_size=2),
    pytest.param(dict(world_size=3, seq_len=10), marks=pytest.mark.exhaustive(
        "the fast tier passes this config for one step in test_collectives_per_step_are_exactly_the_design[3x1], "
        "and three steps at 2 and 4 ranks here")),
    pytest.param(dict(world_size=4), marks=pytest.mark.exhaustive(
        "the fast tier passes this config for one step in test_collectives_per_step_are_exactly_the_design[2x2], "
        "and three steps of the same 2 x 2 mesh here (ws4-mqa-noncausal-uneven, ws4-more-ranks-than-heads)")),
    dict(world_size=4, num_kv_heads=1, causal=False, seq_len=9),
    dict(world_size=4, num_heads=1, hidden=8, num_kv_heads=1),  # heads 1/0 over the Ulysses pair
], ids=["ws2-1x2", "ws3-uneven-3x1", "ws4-2x2", "ws4-mqa-noncausal-uneven", "ws4-more-ranks-than-heads"])
def test_check_passes(sp_check, fields):
    res = sp_check(_resolved(**fields))
    assert res.verdict == "PASS", format_result(res)


@pytest.mark.parametrize("fields, words", [
    (dict(layout="sbh"), "'sbh'"),
    (dict(world_size=4, ring_degree=3), "ring_degree(3) does not divide sp(4)"),
])
def test_declared_unsupported_names_the_numbers(fields, words):
    config = _resolved(**fields)
    with pytest.raises(Unsupported, match=words.replace("(", r"\(").replace(")", r"\)")):
        get_case(CASE).validate(config)


def test_strategy_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_world_size"):
        usp_configs(min_world_size=3, max_world_size=2)
    with pytest.raises(ValueError, match="max_tokens"):
        usp_configs(max_tokens=0)


@given(data=st.data())
def test_usp_configs_get_their_expected_verdict(sp_check, sp_max_world_size, data):
    config = data.draw(usp_configs(max_world_size=min(4, sp_max_world_size)), label="config")
    config = config.replace(timeout_s=TIMEOUT)
    res = sp_check(config)
    want = expected_verdict(config)
    note(format_result(res))
    assert res.verdict == want, f"expected {want}, got {res.verdict}: {res.reason}\nrepro: {res.config.repro()}"


@pytest.mark.exhaustive("the fast tier kills mutant-usp-ring-low-groups at the forward at 4 ranks (2 x 2) in "
                        "test_mutants (its pinned entry, 2x2); the PASS where U or R is 1 is the next test")
def test_ring_low_groups_mutant_is_killed_where_u_and_r_are_both_above_1(sp_check):
    from sp_harness.cases.usp.mutants import RING_LOW_GROUPS

    res = sp_check(_resolved(world_size=4, steps=1).replace(case=RING_LOW_GROUPS.name))
    assert res.verdict == "FAIL" and res.first_check == "forward", format_result(res)


def test_ring_low_groups_mutant_is_the_correct_case_where_u_or_r_is_1(sp_check):
    from sp_harness.cases.usp.mutants import RING_LOW_GROUPS

    # where U or R is 1 the two layouts coincide: the mutant is the correct case there
    assert sp_check(_resolved(world_size=2, steps=1).replace(case=RING_LOW_GROUPS.name)).verdict == "PASS"


def test_dp_replicas_with_identical_one_key_rows_pass_their_structurally_zero_key_bias_grad(sp_check):
    # the device campaign's false alarm (thirteenth session): batch 1 per replica over 2 DP
    # replicas whose one-token sequences coincide (vocab 2); the k-bias grad is 0 in exact
    # arithmetic and the sharded run's flash-style row sum errs alike in both replicas, where the
    # perturbed reference's row-sum error took a random sign per row and cancelled (7.5x, FAIL)
    config = CheckConfig(case=CASE, world_size=4, dp=2, batch=1, dtype="float32", steps=1, seed=1, hidden=4,
                         ffn=1, num_heads=2, load_balancer="none", ring_degree=1, vocab=2, seq_shards=(1, 0),
                         adversary="reorder-tf32", timeout_s=TIMEOUT)
    res = sp_check(config)
    assert res.verdict == "PASS", format_result(res)
