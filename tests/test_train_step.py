"""The training-step check: the built-in cases' own steps PASS against the intended loss over
every dtype, optimizer and clipping mode; a case without a step is a one-line setup error; the
masks make the bugs visible; a uniform grad factor is named. The ten training-step mutants are
killed at their pinned stages in tests/test_mutants.py (battery entry "train-step")."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from sp_harness.checks import train_step
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.config.strategies import train_step_configs
from sp_harness.report.result_text import format_result
from sp_harness.step.context import reference_context
from sp_harness.step.train_batches import micro_batches


def _train(case, **fields):
    return CheckConfig(case=case, train_step=True, **fields)


@pytest.mark.parametrize("case, fields", [
    pytest.param("megatron-gpt-sp", dict(world_size=4, dp=2, optimizer="sgd", clip_grad_norm=0.01),
                 marks=pytest.mark.exhaustive(
                     "test_mutants passes megatron-gpt-sp on this very config (the train-step entry: 2 x 2, K = 3, "
                     "SGD, clipping, float64) as the twin of its train-step mutants; every stage and the clip "
                     "coefficient are asserted judged below on ring-gpt's SGD step with clipping")),
    ("megatron-gpt-sp", dict(world_size=4, dp=2, optimizer="adamw", dtype="float32")),
    ("megatron-gpt-sp", dict(world_size=4, dp=2, optimizer="sgd", dtype="bfloat16", clip_grad_norm=0.01)),
    ("ring-gpt", dict(world_size=4, dp=2, optimizer="sgd", dtype="float32", clip_grad_norm=0.01)),
    ("ring-gpt", dict(world_size=4, dp=2, optimizer="adamw", dtype="bfloat16")),
])
def test_built_in_steps_pass(sp_pool, case, fields):
    res = train_step.check(_train(case, micro_batches=3, **fields), sp_pool)
    assert res.verdict == "PASS", format_result(res)
    # every stage was judged: loss, grads, the norm (its composition and total) and the update
    judged = set(res.worst)
    assert {"loss", "grad", "grad_norm", "param"} <= judged, judged
    if fields.get("clip_grad_norm") and fields["optimizer"] == "sgd":
        # a bfloat16 param rounds away an SGD update of lr x coefficient x grad: the coefficient
        # is listed not judged there (its bound would pass a coefficient of 0), judged elsewhere
        withheld = any(c.kind == "clip" for c in res.vacuous)
        assert withheld == (fields.get("dtype") == "bfloat16") != ("clip" in judged), format_result(res)


@given(data=st.data())
def test_correct_steps_pass_over_drawn_configs(sp_pool, sp_max_world_size, data):
    case = data.draw(st.sampled_from(("megatron-gpt-sp", "ring-gpt")), label="case")
    config = data.draw(train_step_configs(case, max_world_size=min(4, sp_max_world_size), bsh_only=case == "ring-gpt"),
                       label="config")
    res = train_step.check(config, sp_pool)
    note(format_result(res))
    assert res.verdict != "FAIL", f"{res.reason}\nrepro: {res.config.repro()}"


def test_uniform_grad_factor_is_named(sp_pool):
    res = train_step.check(_train("mutant-train-ga-times-sp", world_size=4, dp=2, optimizer="sgd", steps=1), sp_pool)
    assert res.verdict == "FAIL" and res.first_check == "grad"
    assert res.grad_factor == pytest.approx(0.5, rel=1e-6)
    assert "every param grad is 0.500x the reference" in res.reason


def test_clipping_inactive_and_a_wrong_clip_coefficient_are_told_apart(sp_pool):
    # a max norm far above the grad norm: clipping inactive, no clip stage, still PASS
    res = train_step.check(_train("megatron-gpt-sp", world_size=2, optimizer="sgd", clip_grad_norm=1e6), sp_pool)
    assert res.verdict == "PASS" and "clip" not in res.worst, format_result(res)


def test_masks_make_the_counts_differ():
    case = get_case("megatron-gpt-sp")
    config = case.resolve(_train("megatron-gpt-sp", world_size=4, dp=2))
    ctx = dataclasses.replace(reference_context(config, torch.device("cpu")), dp_rank=0, tp_rank=0,
                              tp_ranks=(0, 1), dp_ranks=(0, 2), seq_shards=(6, 6), world_size=4)
    from sp_harness.step.inputs import batch_generator

    made = micro_batches(case, config, 0, batch_generator(0), layout=case.input_layout, ctx=ctx)
    valid = [(b.target != -100) for b in made]
    counts = [int(v.sum()) for v in valid]
    assert len(made) == 3 and counts[-1] == 0 and all(c > 0 for c in counts[:-1]), counts
    assert counts[0] != counts[1]
    # the last DP replica's last sequence shard holds no valid token in any micro-batch
    assert not any(bool(v[2:, 6:].any()) for v in valid)


def test_a_case_without_a_step_is_a_one_line_setup_error(capsys, monkeypatch):
    from sp_harness import cli

    # `main` in this process, as `python -m sp_harness.cli` runs it (test_cli_errors runs the
    # usage errors through an interpreter of its own, its exit status included), less its
    # SIGINT/SIGTERM handlers, which are pytest's process's to keep
    monkeypatch.setattr(cli.signal, "signal", lambda *_: None)
    code = cli.main(["check", "--case", "seed-mlp", "--train-step"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "seed-mlp declares no training step" in lines[0], err
    assert "megatron-gpt-sp" in lines[0]


def test_train_step_and_forward_only_exclude_each_other():
    with pytest.raises(ValueError, match="train_step and forward_only"):
        CheckConfig(case="megatron-gpt-sp", train_step=True, forward_only=True)


def test_json_carries_the_stage_and_the_factor(tmp_path, sp_pool):
    from sp_harness.checks import get_check, run_check
    from sp_harness.report.text import dump_json

    config = _train("mutant-train-loss-times-sp", world_size=2, optimizer="sgd", steps=1)
    outcome = run_check(get_check("train-step"), config, sp_pool)
    assert (outcome.status, outcome.caught_by) == ("fail", "reported loss")
    path = tmp_path / "out.json"
    dump_json([outcome], str(path))
    record = json.loads(path.read_text())["outcomes"][0]
    assert record["figures"]["grad_factor"] == pytest.approx(2.0, rel=1e-6)


INVARIANCE_KILLS = {
    # mutant -> (fails accumulation invariance, fails degree invariance), float64, 2 x 2, K = 3
    "mutant-train-mean-of-means": (True, False),
    "mutant-train-drop-middle-microbatches": (True, False),
    "mutant-train-cp-local-count": (True, True),
    "mutant-train-dp-local-count": (True, True),
    "mutant-train-loss-times-sp": (False, True),
    "mutant-train-sp-grads-unsynced": (False, True),
    "mutant-train-ga-times-sp": (False, True),
    "mutant-train-logged-loss-per-rank": (True, True),
    # the clip norm's bugs leave loss and grads alone: the train-step check's norm stage sees them
    "mutant-train-clip-missing-param": (False, False),
    "mutant-train-norm-avg-shards": (False, False),
}


def _invariance(sp_pool, name, case, dtype="float64"):
    from sp_harness.checks import get_check, run_check

    config = _train(case, world_size=4, dp=2, micro_batches=3, optimizer="sgd", dtype=dtype)
    return run_check(get_check(name), config, sp_pool)


@pytest.mark.parametrize("case, dtype", [
    pytest.param("megatron-gpt-sp", "float64", marks=pytest.mark.exhaustive(
        "the fast tier runs both invariances in float64 on megatron-gpt-sp's step with only its clip norm wrong "
        "(mutant-train-clip-missing-param, -norm-avg-shards: loss and grads the correct step's, unclipped here) "
        "and asserts both pass, below")),
    ("megatron-gpt-sp", "float32"), ("megatron-gpt-sp", "bfloat16"),
    ("ring-gpt", "float64"), ("ring-gpt", "float32"), ("ring-gpt", "bfloat16")])
def test_correct_steps_are_invariant(sp_pool, case, dtype):
    for name in ("accumulation-invariance", "degree-invariance"):
        outcome = _invariance(sp_pool, name, case, dtype)
        assert outcome.status == "pass", f"{name}: {outcome.detail}"


@pytest.mark.parametrize("mutant", sorted(INVARIANCE_KILLS))
def test_invariance_checks_fail_on_the_mutants_they_exist_for(sp_pool, mutant):
    got = tuple(_invariance(sp_pool, name, mutant).status == "fail"
                for name in ("accumulation-invariance", "degree-invariance"))
    assert got == INVARIANCE_KILLS[mutant]


@pytest.mark.exhaustive("test_mutants passes megatron-gpt-sp through this lockstep check at 2 ranks (the twin of "
                        "mutant-sp-clip-norm-counts-replicas, entry lockstep); the mutant's fail is the next test")
def test_converge_passes_the_correct_case(sp_pool):
    from sp_harness.checks import get_check, run_check

    assert run_check(get_check("lockstep"), CheckConfig(case="megatron-gpt-sp", world_size=2), sp_pool).status == "pass"


def test_converge_trains_the_case_s_own_step(sp_pool):
    from sp_harness.checks import get_check, run_check

    lockstep = get_check("lockstep")
    # the norm's averaged shards are only in the case's own step: the lockstep gate sees its
    # grad norm, so the convergence run trains that step and records what it reports
    outcome = run_check(lockstep, CheckConfig(case="mutant-train-norm-avg-shards", world_size=2), sp_pool)
    assert outcome.status == "fail", outcome.detail


def test_a_training_batch_splits_into_micro_batches_that_keep_each_replica_s_rows():
    from sp_harness.config.case import Batch
    from sp_harness.step.train_batches import micro_batch_count, split_rows

    rows = torch.arange(8).view(8, 1).expand(8, 3)  # dp 2 x 4 rows per replica
    parts = split_rows(Batch(inputs={"tokens": rows}, target=rows), 2, 2, 0)
    assert [p.target[:, 0].tolist() for p in parts] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert micro_batch_count(8, 3) == 2 and micro_batch_count(6, 3) == 3 and micro_batch_count(5, 3) == 1
