"""The Hugging Face transformers Trainer's own training step (sp_harness.cases.frameworks.hf.case)
under the training-step check, on real gloo ranks: its gradient accumulation over K = 3 uneven
micro-batches, `num_items_in_batch` gathered over the DP ranks, DDP through accelerate, clipping
and its optimizer PASS against the same HF model in float64 on one device (Llama and Qwen2, a
user's compute_loss override and compute_loss_func); the Trainer's two shipped gradient-
accumulation bugs, reintroduced through a Trainer subclass, FAIL at the reported loss on the
same config while their twin passes."""

import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("transformers", "transformers is not installed (pip install -e '.[hf]')")
skip_unless_installed("accelerate", "accelerate is not installed (pip install -e '.[hf]')")

from sp_harness.cases import builtin_modules  # noqa: E402
from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402
from sp_harness.report.result_text import format_result  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer_step.py")
CASES = os.path.join(ROOT, "cases", "frameworks", "hf", "cases.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; transformers' and accelerate's imports are the case's setup."""
CLIPPED_SGD = dict(optimizer="sgd", clip_grad_norm=0.01)
"""Clipping active: the Trainer's grad norm is ~1 here, so every step clips."""


def _builtin(name: str, attr: str) -> str:
    """A built-in case by its registry name where sp_harness.cases lists it, else by its file."""
    return name if name in builtin_modules() else f"{CASES}:{attr}"


def _train(case: str, **fields) -> CheckConfig:
    return CheckConfig(case=case, train_step=True, micro_batches=3, timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("case, fields", [
    (_builtin("hf-trainer-llama", "HF_TRAINER_LLAMA"), dict(world_size=2, dp=2, dtype="float32", **CLIPPED_SGD)),
    (_builtin("hf-trainer-qwen2", "HF_TRAINER_QWEN2"), dict(world_size=4, dp=4, dtype="bfloat16", optimizer="adamw")),
    (_builtin("hf-trainer-llama-user-loss", "HF_TRAINER_USER_LOSS"), dict(world_size=2, dp=2, dtype="bfloat16",
                                                                        **CLIPPED_SGD)),
    (f"{EXAMPLE}:LOSS_FUNC", dict(world_size=4, dp=4, dtype="float32", optimizer="adamw", clip_grad_norm=0.01)),
], ids=["llama-dp2-f32-sgd-clip", "qwen2-dp4-bf16-adamw", "user-compute-loss-dp2-bf16-sgd-clip",
        "compute-loss-func-dp4-f32-adamw-clip"])
def test_the_trainers_own_step_passes(sp_check, case, fields):
    res = sp_check(_train(case, steps=2, **fields))
    assert res.verdict == PASS, format_result(res)
    # every stage was judged: the reported loss, the grads, the norm (composition and total), the update
    assert {"loss", "grad", "grad_norm", "param"} <= set(res.worst), set(res.worst)
    if fields["optimizer"] == "sgd":
        # a bfloat16 param rounds away an SGD update of lr x coefficient x grad: the coefficient
        # is listed not judged there (its bound would pass a coefficient of 0), judged elsewhere
        withheld = any(c.kind == "clip" for c in res.vacuous)
        assert withheld == (fields["dtype"] == "bfloat16") != ("clip" in res.worst), format_result(res)


@pytest.mark.exhaustive("the fast tier runs Llama at float32 and bfloat16, DP 2 and 4, SGD and AdamW")
@pytest.mark.parametrize("case, fields", [
    (_builtin("hf-trainer-llama", "HF_TRAINER_LLAMA"), dict(world_size=2, dp=2, dtype="float64", **CLIPPED_SGD)),
    (f"{EXAMPLE}:MY_LOSS", dict(world_size=4, dp=4, dtype="float32", **CLIPPED_SGD)),
    (f"{EXAMPLE}:LLAMA", dict(world_size=4, dp=4, dtype="bfloat16", optimizer="sgd", clip_grad_norm=0.01)),
], ids=["llama-dp2-f64-sgd-clip", "example-qwen2-compute-loss-dp4-f32-sgd-clip", "llama-dp4-bf16-sgd-clip"])
def test_more_configs_pass(sp_check, case, fields):
    res = sp_check(_train(case, **fields))
    assert res.verdict == PASS, format_result(res)


@pytest.mark.exhaustive("the fast tier kills each of them at its pinned 'reported loss' in test_mutants")
@pytest.mark.parametrize("mutant, attr", [
    ("mutant-hf-trainer-mean-of-micro-batch-means", "MEAN_OF_MEANS"),
    ("mutant-hf-trainer-4470-training-step", "TRAINING_STEP_4470"),
    ("mutant-hf-trainer-label-smoother-per-micro-batch", "SMOOTHER_PER_MICRO_BATCH"),
], ids=["mean-of-micro-batch-means", "4.47.0-training-step", "label-smoother-per-micro-batch"])
def test_shipped_accumulation_bugs_fail_at_the_reported_loss(sp_check, mutant, attr):
    res = sp_check(_train(_builtin(mutant, attr), world_size=2, dp=2, dtype="float32", steps=1, **CLIPPED_SGD))
    assert res.verdict == FAIL and res.first_check == "loss", format_result(res)
    assert "reported loss" in res.reason
    assert any(f.kind == "grad" for f in res.failures)  # the grads are off too, not only the log


def test_what_the_trainer_cannot_run_is_unsupported_before_any_rank(sp_check):
    res = sp_check(_train(_builtin("hf-trainer-llama", "HF_TRAINER_LLAMA"), world_size=2, dp=1))
    assert res.verdict == UNSUPPORTED and "DDP over every rank" in res.reason, res.reason
    res = sp_check(CheckConfig(case=_builtin("hf-trainer-llama", "HF_TRAINER_LLAMA"), world_size=2, dp=2))
    assert res.verdict == UNSUPPORTED and "--train-step" in res.reason, res.reason
