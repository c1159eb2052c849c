"""DeepSpeed's own engine training step (sp_harness.cases.frameworks.deepspeed.step; 0.19.8 pinned,
each release of compat.RELEASES in the release matrix) under the training-step check, on real gloo ranks: deepspeed.initialize, engine.backward and engine.step per
micro-batch over K = 3 uneven micro-batches, ZeRO 0/1/2/3 and CPU optimizer offload, clipping
active, around DeepSpeed's Ulysses DistributedAttention. The correct user loop PASSes every stage;
DeepSpeed's own shipped bugs, put back into its ZeRO optimizer (#7967, #7981; a release that shipped
them runs its own), and a user's loss divided by the accumulation steps twice FAIL at the grads before
clipping. On a release that shipped one of DeepSpeed's engine-step bugs (#7967, #7981, #7509, #7649:
the release cases in deepspeed/cases.py) the correct loop FAILs there at that bug's stage (`shipped`)."""

import pytest
from installed import skip_unless_installed

skip_unless_installed("deepspeed", "DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from sp_harness.cases.frameworks.deepspeed.cases import (  # noqa: E402  (registers)
    BUG_7509,
    BUG_7649,
    BUG_7967,
    BUG_7981,
    SHOWN_7837,
    SHOWN_INIT_STEP,
)
from sp_harness.checks.train_step import STAGE_LABEL  # noqa: E402
from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402

TIMEOUT_S = 180.0
"""Generous for a loaded runner: DeepSpeed's engine initialises inside the first step."""
CLIP = 0.01
"""Far below the grad norm (about 2-4 at init): clipping is active at every step."""


def _train(case: str, **fields) -> CheckConfig:
    return CheckConfig(case=case, train_step=True, micro_batches=3, timeout_s=TIMEOUT_S, **fields)


def shipped(case: str, fields: dict):
    """The DeepSpeed bug the installed release ships on this engine-step config (its release case
    in cases.py), or None: there the correct loop FAILs at the bug's stage."""
    bugs = {"ds-ulysses-step-offload": BUG_7967, "ds-ulysses-step-offload-multi-backward": BUG_7981,
            "ds-ulysses-step-zero2": BUG_7509}
    if case == "ds-ulysses-step" and fields["dtype"] == "float32" and fields.get("clip_grad_norm"):
        bugs[case] = BUG_7649  # stage 0 float32 clips with clip_grad_norm_(mpu=the slim mpu)
    if case == "ds-ulysses-step" and fields["dtype"] == "bfloat16":
        # stage 0 bfloat16 wraps the client optimizer in FP16_UnfusedOptimizer: its init step shows in
        # AdamW's update (SGD's is exact), #7837's loss scale and #7649's missing mpu API in any
        bugs[case] = SHOWN_INIT_STEP if fields["optimizer"] == "adamw" else SHOWN_7837
    bug = bugs.get(case)
    return bug if bug is not None and bug.present() else None


def _expect(res, case: str, fields: dict) -> None:
    bug = shipped(case, fields)
    if bug is None:
        assert res.verdict == PASS, res.reason + res.error
    else:
        stage = STAGE_LABEL.get(res.first_check, res.first_check)  # as killed_by names it
        assert res.verdict == FAIL and stage == bug.stage_here(), (stage, res.reason + res.error)
        if bug is BUG_7649:
            assert "get_model_parallel_rank" in res.reason, res.reason


@pytest.mark.parametrize("case, fields", [
    ("ds-ulysses-step", dict(world_size=2, dtype="float32", optimizer="sgd", clip_grad_norm=CLIP)),
    ("ds-ulysses-step-zero1", dict(world_size=4, dp=2, dtype="bfloat16", optimizer="adamw", clip_grad_norm=CLIP)),
    pytest.param("ds-ulysses-step-offload", dict(world_size=4, dp=2, dtype="float32", optimizer="sgd",
                                                 clip_grad_norm=CLIP), marks=pytest.mark.exhaustive(
        "test_mutants runs ds-ulysses-step-offload on this config (DP 2 x SP 2, K = 3, float32, SGD with clipping "
        "active) as the twin of mutant-ds-step-offload-drops-middle (battery entry train-step)")),
], ids=["zero0-sp2-f32-sgd", "zero1-dp2xsp2-bf16-adamw", "zero2-offload-dp2xsp2-f32-sgd"])
def test_the_engine_step_passes_every_stage(sp_check, case, fields):
    res = sp_check(_train(case, **fields))
    _expect(res, case, fields)
    if shipped(case, fields) is not None:
        return
    judged = set(res.worst)
    assert {"loss", "grad", "grad_norm", "param"} <= judged, judged
    if fields["optimizer"] == "sgd":
        assert "clip" in judged, judged  # clipping was active and its coefficient judged


@pytest.mark.exhaustive("the fast tier runs ZeRO 0, ZeRO 1 and ZeRO 2 with offload")
@pytest.mark.parametrize("case, fields", [
    ("ds-ulysses-step", dict(world_size=4, dp=2, dtype="bfloat16", optimizer="adamw", clip_grad_norm=CLIP)),
    ("ds-ulysses-step-zero2", dict(world_size=4, dp=2, dtype="bfloat16", optimizer="sgd", clip_grad_norm=CLIP)),
    ("ds-ulysses-step-zero2", dict(world_size=2, dp=2, dtype="float32", optimizer="adamw", clip_grad_norm=CLIP)),
    ("ds-ulysses-step-offload", dict(world_size=2, dtype="bfloat16", optimizer="adamw", clip_grad_norm=CLIP)),
    ("ds-ulysses-step-offload-multi-backward", dict(world_size=4, dp=2, dtype="float32", optimizer="sgd",
                                                    clip_grad_norm=CLIP)),
    ("ds-ulysses-step-zero3", dict(world_size=4, dp=2, dtype="float32", optimizer="sgd", clip_grad_norm=CLIP)),
])
def test_more_engine_configurations_pass(sp_check, case, fields):
    res = sp_check(_train(case, **fields))
    _expect(res, case, fields)


@pytest.mark.parametrize("mutant, fields", [
    pytest.param("mutant-ds-step-offload-drops-middle", dict(world_size=2), marks=pytest.mark.exhaustive(
        "test_mutants kills it at its pinned grads before clipping (DP 2 x SP 2, K = 3)")),
    pytest.param("mutant-ds-step-offload-multi-backward-keeps-last", dict(world_size=2), marks=pytest.mark.exhaustive(
        "test_mutants kills it at its pinned grads before clipping (DP 2 x SP 2, K = 3)")),
    # fast tier too: the 1/K grad factor is asserted only here
    ("mutant-ds-step-loss-scaled-by-gas-twice", dict(world_size=4, dp=2)),
])
def test_deepspeeds_step_bugs_fail_at_the_grads(sp_check, mutant, fields):
    # one step: each bug shows in the first step's grads, with clipping active
    res = sp_check(_train(mutant, dtype="float32", optimizer="sgd", clip_grad_norm=CLIP, steps=1, **fields))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason + res.error
    if mutant.endswith("gas-twice") and not BUG_7509.present():  # there its twin's grads are not accumulated
        # the whole grad set is 1/K of the token mean's: the check names the factor
        assert res.grad_factor == pytest.approx(1 / 3, rel=0.02), res.grad_factor


def test_deepspeeds_limits_are_unsupported_before_any_rank_runs(sp_check):
    res = sp_check(_train("ds-ulysses-step", world_size=2, dtype="float64"))
    assert res.verdict == UNSUPPORTED and "torch.float64" in res.reason, res.reason
    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.deepspeed.step import ds_step_case
    from sp_harness.config.registry import get_case

    # ZeRO-3's default reduce_scatter averages over SP too; a param above the persistence threshold
    # is partitioned between forwards
    for ds_config, why in (({"zero_optimization": {"stage": 3}}, "reduce_scatter"),
                           ({"zero_optimization": {"stage": 3, "reduce_scatter": False,
                                                   "stage3_param_persistence_threshold": 10}}, "persistence")):
        case = ds_step_case("ds-zero3-probe", ds_config)
        config = case.resolve(_train("ds-ulysses-step-zero3", world_size=2))
        with pytest.raises(Unsupported, match=why):
            case.validate(config)
    assert get_case("ds-ulysses-step-zero3").train_loss is not None


def test_the_engine_config_is_the_users_plus_the_runs():
    import torch

    from sp_harness.cases.frameworks.deepspeed.step import engine_config

    user = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    made = engine_config(user, batch=2, k=3, dtype=torch.bfloat16, clip=0.01)
    assert made["gradient_accumulation_steps"] == 3 and made["gradient_clipping"] == 0.01
    assert made["bf16"] == {"enabled": True} and made["zero_force_ds_cpu_optimizer"] is False
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        engine_config({**user, "gradient_accumulation_steps": 4}, batch=2, k=3, dtype=torch.float32, clip=None)
