"""megatron-core 0.16.1's OWN training step under the training-step check
(sp_harness.cases.frameworks.megatron.step): its schedule (`forward_backward_no_pipelining`) over
K = 3 uneven micro-batches with pretrain_gpt.py's loss function (`calculate_per_token_loss`),
`finalize_model_grads`, `get_megatron_optimizer` (plain and distributed, fp32 master weights in
bfloat16) and its clipping PASS against the token mean over the global batch, clipping active;
megatron's own normalisation and clip-norm bugs, through its own knobs, FAIL at their stage on the
same config their twin PASSes; what megatron cannot run is UNSUPPORTED before any rank starts."""

import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("megatron.core", "megatron-core is not installed (pip install -e '.[megatron]')")

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402
from sp_harness.report.result_text import format_result  # noqa: E402

EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "megatron_train_step.py")
TIMEOUT_S = 180.0
"""Generous for a loaded runner (a 2 x 2 bfloat16 run takes about 35 s on 2 busy cores);
megatron-core's import is the case's setup, outside it."""
STEP = dict(train_step=True, micro_batches=3, clip_grad_norm=0.01)
"""K = 3 (the last micro-batch empty, one rank without tokens) and a max norm far below the grad
norm (about 0.05 here): clipping is active at every step."""


def _config(name: str, **fields) -> CheckConfig:
    """`name`: a built-in case (mcore-...) or an example's attribute."""
    case = name if name.startswith("mcore-") else f"{EXAMPLE}:{name}"
    return CheckConfig(case=case, timeout_s=TIMEOUT_S, **STEP, **fields)


def _judged_every_stage(res, optimizer: str) -> None:
    stages = {"loss", "grad", "grad_norm", "param"} | ({"clip"} if optimizer == "sgd" else set())
    assert stages <= set(res.worst), (stages, set(res.worst))


@pytest.mark.parametrize("name, fields", [
    ("GPT_SP_STEP", dict(world_size=2, optimizer="sgd", dtype="float32")),
    ("GPT_SP_STEP", dict(world_size=4, dp=2, optimizer="adamw", dtype="bfloat16")),
    ("mcore-gpt-sp-step-distopt", dict(world_size=4, dp=2, optimizer="adamw", dtype="float32")),
    # your loss in megatron's own step: label smoothing with the whole vocabulary's statistics, padding
    ("GPT_SP_STEP_SMOOTHED", dict(world_size=4, dp=2, optimizer="sgd", dtype="float32")),
    pytest.param("GPT_SP_STEP", dict(world_size=4, dp=2, optimizer="sgd", dtype="float32"),
                 marks=pytest.mark.exhaustive("the fast tier runs SGD float32 at TP 2 and DP 2 x TP 2 with AdamW")),
    pytest.param("GPT_SP_STEP", dict(world_size=2, optimizer="adamw", dtype="bfloat16"),
                 marks=pytest.mark.exhaustive("the fast tier runs bfloat16 AdamW at DP 2 x TP 2")),
    pytest.param("GPT_SP_STEP_DISTOPT", dict(world_size=4, dp=2, optimizer="adamw", dtype="bfloat16"),
                 marks=pytest.mark.exhaustive("the fast tier runs the distributed optimizer at float32")),
])
def test_megatrons_own_step_passes(sp_check, name, fields):
    res = sp_check(_config(name, **fields))
    assert res.verdict == PASS, format_result(res)
    _judged_every_stage(res, fields["optimizer"])


def test_per_microbatch_local_token_mean_fails_at_the_grads(sp_check):
    # megatron's calculate_per_token_loss=False: each micro-batch's sum over its own tokens / K;
    # the logged loss is still sum / count over the global batch, so only the grads show it.
    # Its twin passes on this config above (GPT_SP_STEP, TP 2, SGD, float32).
    res = sp_check(_config("LOCAL_TOKEN_MEAN", world_size=2, optimizer="sgd", dtype="float32"))
    assert res.verdict == FAIL and res.first_check == "grad", format_result(res)
    assert "loss" not in {f.kind for f in res.failures}, res.reason


@pytest.mark.exhaustive("the fast tier runs the local-token-mean mutant at TP 2, one replica")
def test_per_replica_local_token_mean_fails_at_the_grads_with_dp(sp_check):
    res = sp_check(_config("LOCAL_TOKEN_MEAN", world_size=4, dp=2, optimizer="sgd", dtype="float32"))
    assert res.verdict == FAIL and res.first_check == "grad", format_result(res)


def test_a_tp_split_param_counted_on_tp_rank_0_only_fails_at_the_grad_norm(sp_check):
    # the qkv bias without its tensor_model_parallel flag: megatron's norm keeps TP rank 0's shard
    res = sp_check(_config("CLIP_NORM_TP_RANK0", world_size=2, optimizer="sgd", dtype="float32"))
    assert res.verdict == FAIL and res.first_check == "grad_norm", format_result(res)
    assert "linear_qkv.bias in the norm" in res.reason, res.reason


@pytest.mark.parametrize("name, fields, why", [
    ("GPT_SP_STEP", dict(world_size=2, optimizer="sgd", dtype="float64"), "float32 or bfloat16"),
    ("GPT_SP_STEP_DISTOPT", dict(world_size=2, optimizer="sgd", dtype="float32"), "Adam only"),
])
def test_what_megatron_cannot_run_is_unsupported(sp_check, name, fields, why):
    res = sp_check(_config(name, **fields))
    assert res.verdict == UNSUPPORTED and why in res.reason, res.reason
