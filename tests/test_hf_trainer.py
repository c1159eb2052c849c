"""The Hugging Face transformers Trainer's own training step (sp_harness.cases.frameworks.hf.case)
under the training-step check, on real gloo ranks: its gradient accumulation over K = 3 uneven
micro-batches, `num_items_in_batch` gathered over the DP ranks, DDP through accelerate, clipping
and its optimizer PASS against the same HF model in float64 on one device (Llama and Qwen2, a
user's compute_loss override and compute_loss_func); the Trainer's two shipped gradient-
accumulation bugs, reintroduced through a Trainer subclass, FAIL at the reported loss on the
same config while their twin passes.

On whichever release of the supported range is installed (the release matrix runs this file on
each, tox.ini's hf block): where that release shipped one of the accumulation bugs
(sp_harness.cases.frameworks.hf.cases.SHIPPED) a correct case FAILs at the reported loss (the
grads at bfloat16, whose loss bound is wider), or its user code, written for `num_items_in_batch`, raises on the None the release hands it; where the
release lacks an API the user's code relies on, the case is UNSUPPORTED naming it; else it
PASSes."""

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
from hf_sp_path import runs_here
from installed import skip_unless_installed

skip_unless_installed("transformers", "transformers is not installed (pip install -e '.[hf]')")
skip_unless_installed("accelerate", "accelerate is not installed (pip install -e '.[hf]')")

from sp_harness.cases import builtin_modules  # noqa: E402
from sp_harness.cases.frameworks.hf.cases import (  # noqa: E402
    DOUBLED_LOSS_BUG,
    GRADS_DIVIDED_TWICE_BUG,
    MEAN_OF_MEANS_BUG,
)
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


@functools.cache
def _capabilities() -> dict:
    """What the installed Trainer has (sp_harness.cases.frameworks.hf.compat), asked in a child
    interpreter: this process imports no framework (the rank processes' fork server must not
    inherit transformers' threads)."""
    code = ("import json; from sp_harness.cases.frameworks.hf import compat as c; print(json.dumps(dict("
            "num_items_in_batch=c.passes_num_items_in_batch(), compute_loss_func=c.takes_compute_loss_func())))")
    # its own TMPDIR, removed after: transformers' import makes torch's inductor cache folder there
    with tempfile.TemporaryDirectory(prefix="sp-harness-test-") as scratch:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True,
                              env={**os.environ, "TMPDIR": scratch})
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def _release_note() -> str:
    from sp_harness.cases.frameworks.releases import installed_release

    return f"transformers {installed_release('transformers')}, accelerate {installed_release('accelerate')}"


def _expected(*, needs: str = "", raises: bool = False) -> str:
    """The verdict a correct case has on the installed release: UNSUPPORTED where the release lacks
    `needs` (a capability of `_capabilities`); FAIL where it shipped one of the accumulation bugs
    (at the reported loss or the grads, or, `raises`, in the user's code, on the None
    `num_items_in_batch` 4.47.0 hands compute_loss); else PASS."""
    if needs and not _capabilities()[needs]:
        return UNSUPPORTED
    if DOUBLED_LOSS_BUG.present() or (not raises and MEAN_OF_MEANS_BUG.present()):
        return FAIL
    if GRADS_DIVIDED_TWICE_BUG.present():  # 5.2 to 5.5.3: every grad 1/K, the loss right (K = 3 here)
        return FAIL
    return PASS


def _assert_as_the_release_shipped(res, expected: str, *, needs: str = "", raises: bool = False) -> bool:
    """Asserts `res` is `expected` (see `_expected`), with the reason that names the bug or the
    missing API; True where it PASSed (its stages are then the caller's to check)."""
    note = f"on {_release_note()}: {format_result(res)}"
    assert res.verdict == expected, note
    if expected == UNSUPPORTED:
        assert needs in res.reason, note
    elif expected == FAIL and raises:
        assert "NoneType" in note, note  # the user's `/ num_items_in_batch` on the release's None
    elif expected == FAIL:
        # the reported loss first, or, where its bound is a bfloat16 one, the grads; both are off
        assert res.first_check in ("loss", "grad") and any(f.kind == "grad" for f in res.failures), note
    return expected == PASS


def _builtin(name: str, attr: str) -> str:
    """A built-in case by its registry name where sp_harness.cases lists it, else by its file."""
    return name if name in builtin_modules() else f"{CASES}:{attr}"


def _train(case: str, **fields) -> CheckConfig:
    return CheckConfig(case=case, train_step=True, micro_batches=3, timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("case, fields, user", [
    (_builtin("hf-trainer-llama", "HF_TRAINER_LLAMA"), dict(world_size=2, dp=2, dtype="float32", **CLIPPED_SGD), {}),
    (_builtin("hf-trainer-qwen2", "HF_TRAINER_QWEN2"), dict(world_size=4, dp=4, dtype="bfloat16", optimizer="adamw"),
     {}),
    (_builtin("hf-trainer-llama-user-loss", "HF_TRAINER_USER_LOSS"), dict(world_size=2, dp=2, dtype="bfloat16",
                                                                        **CLIPPED_SGD),
     dict(needs="num_items_in_batch", raises=True)),
    (f"{EXAMPLE}:LOSS_FUNC", dict(world_size=4, dp=4, dtype="float32", optimizer="adamw", clip_grad_norm=0.01),
     dict(needs="compute_loss_func", raises=True)),
], ids=["llama-dp2-f32-sgd-clip", "qwen2-dp4-bf16-adamw", "user-compute-loss-dp2-bf16-sgd-clip",
        "compute-loss-func-dp4-f32-adamw-clip"])
def test_the_trainers_own_step_passes(sp_check, case, fields, user):
    # on every release: 4.46.3's and 4.47.1's Qwen2 fill a padded query's mask row with
    # finfo(float64).min, which the perturbed reference now keeps finite (its bound was NaN there)
    res = sp_check(_train(case, steps=2, **fields))
    if not _assert_as_the_release_shipped(res, _expected(**user), **user):
        return  # FAIL or UNSUPPORTED as the installed release shipped, asserted with its reason
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
    user = dict(needs="num_items_in_batch", raises=True) if "MY_LOSS" in case else {}
    res = sp_check(_train(case, **fields))
    _assert_as_the_release_shipped(res, _expected(**user), **user)


@pytest.mark.exhaustive("the fast tier kills each of them at its pinned 'reported loss' in test_mutants")
@pytest.mark.parametrize("mutant, attr", [
    ("mutant-hf-trainer-mean-of-micro-batch-means", "MEAN_OF_MEANS"),
    ("mutant-hf-trainer-4470-training-step", "TRAINING_STEP_4470"),
    ("mutant-hf-trainer-label-smoother-per-micro-batch", "SMOOTHER_PER_MICRO_BATCH"),
], ids=["mean-of-micro-batch-means", "4.47.0-training-step", "label-smoother-per-micro-batch"])
def test_shipped_accumulation_bugs_fail_at_the_reported_loss(sp_check, mutant, attr):
    if attr == "TRAINING_STEP_4470" and not _capabilities()["num_items_in_batch"]:
        pytest.skip(f"{_release_note()}: 4.47.0's training_step reads model_accepts_loss_kwargs and "
                    f"num_items_in_batch, which this release's Trainer has not")
    res = sp_check(_train(_builtin(mutant, attr), world_size=2, dp=2, dtype="float32", steps=1, **CLIPPED_SGD))
    assert res.verdict == FAIL and res.first_check == "loss", format_result(res)
    assert "reported loss" in res.reason
    assert any(f.kind == "grad" for f in res.failures)  # the grads are off too, not only the log


def test_what_the_trainer_cannot_run_is_unsupported_before_any_rank(sp_check):
    # SP 2 with K = 3: DeepSpeed's SP data-loader adapter takes one batch from each SP rank per round
    # (where the installed accelerate has the SP path at all: else that is the reason, hf_sp_path)
    res = sp_check(_train(_builtin("hf-trainer-llama", "HF_TRAINER_LLAMA"), world_size=2, dp=1))
    if runs_here(res):
        assert res.verdict == UNSUPPORTED and "must be a multiple of SP" in res.reason, res.reason
    res = sp_check(CheckConfig(case=_builtin("hf-trainer-llama", "HF_TRAINER_LLAMA"), world_size=2, dp=2))
    assert res.verdict == UNSUPPORTED and "--train-step" in res.reason, res.reason
