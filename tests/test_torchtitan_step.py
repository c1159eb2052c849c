"""torchtitan 0.3.0's own trainer step (sp_harness.cases.frameworks.torchtitan.step) under the
training-step check, on real gloo ranks: `Trainer.train_step` (K = 3 uneven micro-batches, the
loss over the global valid-token count), `clip_grad_norm_` (active: max_norm 0.01) and its
`OptimizersContainer` on llama3 under its TP + SP plan, at TP 2 and DP 2 x TP 2 (its FSDP2).
Correct configs PASS; each mutant, a shipped torchtitan bug, FAILs at the stage it breaks."""

import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("torchtitan", "torchtitan is not installed (pip install -e '.[torchtitan]')")

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402

EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "torchtitan_train_step.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; torchtitan's import is the case's setup, outside it."""


def _config(name: str, **fields) -> CheckConfig:
    fields = {"train_step": True, "micro_batches": 3, "clip_grad_norm": 0.01, "dtype": "float32", **fields}
    return CheckConfig(case=f"{EXAMPLE}:{name}", timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("world_size,dp,dtype,optimizer", [
    pytest.param(2, 1, "float32", "sgd", marks=pytest.mark.exhaustive(
        "test_mutants runs titan-llama3-sp-step (the same step) at DP 2 x TP 2 in float32 with SGD and clipping "
        "active, K = 3, as the twin of its three step mutants (battery entry train-step-f32)")),
    # DP 2 x TP 2: torchtitan's FSDP2, its grad division off
    pytest.param(4, 2, "bfloat16", "adamw", marks=pytest.mark.exhaustive(
        "the fast tier runs bfloat16 AdamW at TP 2 here, and DP 2 x TP 2 (its FSDP2) in float32 as the step "
        "mutants' twin (titan-llama3-sp-step, battery entry train-step-f32)")),
    pytest.param(4, 2, "float32", "sgd", marks=pytest.mark.exhaustive(
        "test_mutants runs titan-llama3-sp-step on this config as the twin of its three step mutants "
        "(battery entry train-step-f32)")),
    (2, 1, "bfloat16", "adamw"),
])
def test_torchtitan_trainer_step_passes(sp_check, world_size, dp, dtype, optimizer):
    res = sp_check(_config("LLAMA3_SP_STEP", world_size=world_size, dp=dp, dtype=dtype, optimizer=optimizer))
    assert res.verdict == PASS, res.reason + res.error
    assert {"loss", "grad", "grad_norm", "param"} <= set(res.worst), res.worst


@pytest.mark.parametrize("name,world_size,dp,stage", [
    # pytorch/torchtitan#2206 undone: each micro-batch's own token mean / K (an empty one weighs as much)
    pytest.param("PER_MICRO_BATCH_MEAN", 2, 1, "loss", marks=pytest.mark.exhaustive(
        "test_mutants kills mutant-titan-step-per-micro-batch-mean (the same bug) at its pinned stage")),
    # pytorch/torchtitan#2318: FSDP still averages over DP a loss already over the global tokens: grads x 1/2
    # (fast tier too: the grad factor is asserted only here)
    ("FSDP_DIVIDES_TWICE", 4, 2, "grad"),
    # pytorch/torchtitan#596: the clip norm over each rank's local pieces, never reduced
    pytest.param("CLIP_NORM_LOCAL_SHARD", 2, 1, "grad_norm", marks=pytest.mark.exhaustive(
        "test_mutants kills mutant-titan-step-clip-norm-local-shard (the same bug) at its pinned stage")),
])
def test_torchtitan_step_bug_fails_at_its_stage(sp_check, name, world_size, dp, stage):
    res = sp_check(_config(name, world_size=world_size, dp=dp, optimizer="sgd", steps=1))
    assert res.verdict == FAIL and res.first_check == stage, (res.verdict, res.first_check, res.reason + res.error)
    if name == "FSDP_DIVIDES_TWICE":
        assert res.grad_factor is not None and abs(res.grad_factor - 0.5) < 0.01, res.grad_factor


def test_float64_step_is_unsupported_naming_the_float32_loss(sp_check):
    res = sp_check(_config("LLAMA3_SP_STEP", world_size=2, dtype="float64", optimizer="sgd"))
    assert res.verdict == UNSUPPORTED and "float32" in res.reason, res.reason


def test_context_parallel_is_unsupported_before_ranks_start():
    # torchtitan's CP for SDPA is torch's CP dispatcher: no CPU kernel has a sharding rule there
    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.torchtitan.step import titan_train_case

    case = titan_train_case("titan-cp-step", dict(dim=32, n_layers=2, n_heads=4, vocab_size=64), context_parallel=2)
    assert case.validate is not None
    with pytest.raises(Unsupported, match="context parallelism"):
        case.validate(CheckConfig(case="titan-cp-step", world_size=2, train_step=True))
