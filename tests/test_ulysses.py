"""ulysses-gpt beyond the tensors: exact collective accounting per step, the loss across shard
boundaries (a rank with no target tokens included), declared UNSUPPORTED configs, and generated
configs each reaching its expected verdict."""

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from sp_harness.cases.ulysses.mappings import kv_heads, query_heads
from sp_harness.cases.ulysses.strategies import ulysses_configs
from sp_harness.config.case import Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.config.shards import chunk_sizes
from sp_harness.judge.expect import expected_verdict
from sp_harness.report.result_text import format_result

CASE = "ulysses-gpt"
TIMEOUT = 180.0  # a shared 2-core machine: no wall-clock claim, only room to finish


def _resolved(**fields) -> CheckConfig:
    return get_case(CASE).resolve(CheckConfig(case=CASE, timeout_s=TIMEOUT, **fields))


def _expected_rows(config: CheckConfig) -> dict[tuple[str, str, str], tuple[int, int]]:
    """(phase, kind, group) -> (count, bytes) on rank 0 for one step, from the design: per layer
    4 all-to-alls forward (q, k, v seq->heads; the output heads->seq) and their 4 conjugates in
    backward, each counted with the bytes rank 0 sends (all_to_all_single's input); one
    coalesced all-reduce of every grad over SP, one over DP."""
    sp, b = config.tp, config.batch
    seq = config.seq_shards or chunk_sizes(config.seq_len, sp)
    d, s0, s = config.hidden // config.num_heads, seq[0], sum(seq)
    q_for = query_heads(config.num_heads, sp)
    kv_for = kv_heads(q_for, config.num_heads, config.num_kv_heads)
    h0, kv0, kv_sent = len(q_for[0]), len(kv_for[0]), sum(len(h) for h in kv_for)
    fwd = b * d * (config.num_heads * s0 + 2 * kv_sent * s0 + h0 * s)  # q, k, v, then y back
    bwd = b * d * (config.num_heads * s0 + h0 * s + 2 * kv0 * s)  # grad y, then grads of q, k, v
    rows = {}
    if sp > 1:
        rows[("forward", "all_to_all", "tp")] = (4 * config.num_layers, 8 * fwd * config.num_layers)
        rows[("backward", "all_to_all", "tp")] = (4 * config.num_layers, 8 * bwd * config.num_layers)
    params = sum(p.numel() for p in get_case(CASE).build_reference(config).parameters())
    if sp > 1:
        rows[("grad_sync", "all_reduce", "tp")] = (1, 8 * params)
    if config.dp > 1:
        rows[("grad_sync", "all_reduce", "dp")] = (1, 8 * params)
    return rows


@pytest.mark.parametrize("fields", [
    dict(world_size=2),
    dict(world_size=3, seq_len=10),  # uneven tokens 4/4/2, heads 2/1/1, k/v head 1 sent twice
    dict(world_size=3, seq_shards=(0, 4, 1)),  # rank 0 sends nothing of its own
    dict(world_size=4, dp=2, seq_len=7),
    dict(world_size=1),  # a group of one: no collective at all
], ids=["even", "uneven", "empty-rank0", "dp2xsp2", "single"])
def test_collectives_per_step_are_exactly_the_design(sp_check, fields):
    config = _resolved(steps=1, **fields)  # one step's collectives, as in test_usp
    res = sp_check(config)
    assert res.verdict == "PASS", res.reason
    got = {(r.phase, r.kind, r.group): (r.count, r.bytes) for r in res.comm}
    assert got == _expected_rows(config), format_result(res)


def test_loss_normalisation_and_label_shift_with_an_empty_rank(sp_check):
    # rank 1 holds no tokens and no targets; ranks 0 and 2 meet at no boundary of their own; the
    # loss is judged at the first step, before any grad: one step shows it
    config = _resolved(world_size=3, seq_shards=(4, 0, 3), steps=1)
    ok = sp_check(config)
    assert ok.verdict == "PASS", ok.reason
    for mutant in ("mutant-ulysses-loss-mean-per-rank", "mutant-ulysses-label-shift-per-shard"):
        bad = sp_check(config.replace(case=mutant))
        assert bad.verdict == "FAIL", f"{mutant} passed on shards 4/0/3"
        assert bad.first_check == "loss", format_result(bad)  # the loss itself, before any grad


def test_a_two_unit_bf16_mlp_passes_its_fc2_weight_grad_whose_error_sits_in_one_unit(sp_check, sp_max_world_size):
    # the fourteenth session's campaign: one unit barely fires, its inputs err far more than u
    # relative, and the fc2 weight grad's error sits in that unit's column at 8x the members'.
    # 1.29x when a plain sum lost alt's term at equal-weight degrees of freedom (34.6); the fewer
    # of the two error terms' counts (10.4) and the narrow-piece rule: 0.68 (docs/tolerance.md)
    if sp_max_world_size < 4:
        pytest.skip("needs 4 ranks")
    config = CheckConfig(case="ulysses-gpt", world_size=4, dtype="bfloat16", steps=2, hidden=150, ffn=2,
                         num_heads=6, num_kv_heads=1, prompt_len=10, vocab=10, seq_shards=(90, 88, 0, 112),
                         adversary="reorder")
    res = sp_check(config)
    assert res.verdict == "PASS", format_result(res)


def test_a_bf16_config_whose_backward_amplifies_rounding_300_fold_withholds_what_it_cannot_judge(sp_check,
                                                                                                   sp_max_world_size):
    # the sixteenth session's false alarm: hidden 4, one head; correct grads erred 10-50x their
    # norm where the references erred about 1x (pos_emb at 4.05x its bound). Their bounds would
    # pass a zero tensor: not judged, and named; what can be judged still is (tolerance.vacuous)
    if sp_max_world_size < 4:
        pytest.skip("needs 4 ranks")
    config = CheckConfig(case="ulysses-gpt", world_size=4, dp=2, dtype="bfloat16", steps=2, seed=119, hidden=4,
                         ffn=14, num_heads=1, num_kv_heads=1, causal=False, prompt_len=2, vocab=9,
                         seq_shards=(3, 3), adversary="reorder-tf32")
    res = sp_check(config)
    assert res.verdict == "PASS", format_result(res)
    withheld = {(c.kind, c.name) for c in res.vacuous}
    assert ("grad", "pos_emb.weight") in withheld and res.worst["grad"].ratio > 0
    # recorded, not judged: the bounds it withholds would have failed it (4.05x when judged)
    assert max(c.withheld_ratio for c in res.withheld_worst if c.name == "pos_emb.weight") > 1
    assert "pos_emb.weight" in format_result(res, verbose=True)


def test_mean_of_means_is_right_on_even_shards(sp_check):
    # the loss mutant differs only where shards differ: a check that it is the split, not the
    # mutant's arithmetic, that the harness catches
    res = sp_check(_resolved(world_size=2, steps=1).replace(case="mutant-ulysses-loss-mean-per-rank"))
    assert res.verdict == "PASS", res.reason


@pytest.mark.parametrize("fields, words", [
    (dict(layout="sbh"), "'sbh'"),
    (dict(ring_degree=2, world_size=4), "ring_degree(2)"),
    (dict(load_balancer="zigzag"), "'zigzag'"),
])
def test_declared_unsupported_names_the_numbers(fields, words):
    config = _resolved(**fields)
    with pytest.raises(Unsupported, match=words.replace("(", r"\(").replace(")", r"\)")):
        get_case(CASE).validate(config)


def test_kv_heads_cover_every_query_head():
    # 4 query heads over 3 ranks are 2/1/1; with 2 k/v heads rank 2 needs k/v head 1, like rank 1
    assert query_heads(4, 3) == ((0, 1), (2,), (3,))
    assert kv_heads(query_heads(4, 3), 4, 2) == ((0,), (1,), (1,))
    assert kv_heads(query_heads(2, 3), 2, 1) == ((0,), (0,), ())


def test_strategy_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_world_size"):
        ulysses_configs(min_world_size=3, max_world_size=2)
    with pytest.raises(ValueError, match="max_tokens"):
        ulysses_configs(max_tokens=0)


@given(data=st.data())
def test_generated_configs_reach_their_expected_verdict(sp_check, sp_max_world_size, data):
    config = data.draw(ulysses_configs(max_world_size=min(4, sp_max_world_size)), label="config")
    config = config.replace(timeout_s=TIMEOUT)
    res = sp_check(config)
    want = expected_verdict(config)
    note(format_result(res))
    assert res.verdict == want, f"expected {want}, got {res.verdict}: {res.reason}\nrepro: {res.config.repro()}"
