"""The HF Trainer's sequence parallelism (sp_harness.cases.frameworks.hf.sp): the Trainer's own step
over accelerate's ParallelismConfig(sp_size=2, sp_backend="deepspeed"), i.e. DeepSpeed's Ulysses
(UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, the engine with ZeRO-1), at DP 2 x SP 2 on real
gloo ranks, against the same HF model in float64 on one device over the whole global batch.

- A user's token-mean loss (`SPTokenMean`) PASSes in float32 and bfloat16.
- The Trainer's own SP loss, as shipped, FAILs at the reported loss (the release case: the mean of
  per-micro-step SP-group means, its grads x sp_size of that loss's).
- The mutants from the real SP bugs FAIL at the reported loss with the grads off too.
- An accumulation that is not a multiple of SP is UNSUPPORTED before any rank starts.

Where the installed releases lack the SP path (transformers before 5.3, an accelerate without an
SP backend, a DeepSpeed without UlyssesSPDataLoaderAdapter) every case is UNSUPPORTED naming the
API (`compat.sp_missing`), which the first test asserts instead."""


import pytest
from installed import skip_unless_installed

skip_unless_installed("transformers", "transformers is not installed (pip install -e '.[hf]')")
skip_unless_installed("accelerate", "accelerate is not installed (pip install -e '.[hf]')")
skip_unless_installed("deepspeed", "deepspeed is not installed (pip install -e '.[deepspeed]')")

from hf_sp_path import TIMEOUT_S, runs_here, sp_config  # noqa: E402

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402
from sp_harness.report.result_text import format_result  # noqa: E402


@pytest.mark.parametrize("fields", [
    pytest.param(dict(dtype="float32"), marks=pytest.mark.exhaustive(
        "test_mutants runs hf-trainer-sp-llama as the SP mutants' twin (train-step-sp: float32, SGD with clipping)")),
    dict(dtype="bfloat16"),  # DeepSpeed's bf16 with fp32 masters (float32: the mutants' twin)
    pytest.param(dict(optimizer="sgd", clip_grad_norm=0.01),
                 marks=pytest.mark.exhaustive("the main job checks SGD with DeepSpeed's clipping active"))],
    ids=["f32-adamw", "bf16-adamw", "f32-sgd-clip"])
def test_the_trainers_sp_step_with_a_token_mean_loss_passes(sp_check, fields):
    res = sp_check(sp_config("hf-trainer-sp-llama", **fields))
    if not runs_here(res, scaled_loss=True):
        return
    assert res.verdict == PASS, format_result(res)
    # every stage was judged: the reported loss, the grads, the norm, the update (DeepSpeed's
    # norm is its step's, judged from the reported figure)
    assert {"loss", "grad", "grad_norm", "param"} <= set(res.worst), set(res.worst)


def test_the_trainers_own_sp_loss_fails_at_the_reported_loss(sp_check):
    res = sp_check(sp_config("release-hf-sp-mean-of-means-times-sp"))
    if not runs_here(res):
        return
    assert res.verdict == FAIL and res.first_check == "loss", format_result(res)
    assert any(f.kind == "grad" for f in res.failures)


@pytest.mark.exhaustive("the fast tier kills each at its pinned 'reported loss' in test_mutants (train-step-sp)")
@pytest.mark.parametrize("mutant", ["mutant-hf-trainer-sp-count-divided-by-sp", "mutant-hf-trainer-sp-duplicate-data",
                                    "mutant-hf-trainer-sp-accumulation-count-times-sp"])
def test_the_sp_bugs_fail_at_the_reported_loss_and_the_grads(sp_check, mutant):
    res = sp_check(sp_config(mutant))
    if not runs_here(res, scaled_loss=True):
        return
    assert res.verdict == FAIL and res.first_check == "loss", format_result(res)
    assert any(f.kind == "grad" for f in res.failures)


def test_an_accumulation_not_a_multiple_of_sp_is_unsupported(sp_check):
    res = sp_check(CheckConfig(case="hf-trainer-sp-llama", world_size=4, dp=2, train_step=True, micro_batches=3,
                               timeout_s=TIMEOUT_S))
    assert res.verdict == UNSUPPORTED, format_result(res)
    assert "multiple of SP" in res.reason or "sequence parallelism" in res.reason, res.reason


@pytest.mark.exhaustive("an SP job then a DDP job in the same ranks (18 s); in the fast tier TrainerStep's own assert "
                        "ERRORs any DDP job that runs DeepSpeed's engine")
def test_a_ddp_trainer_job_after_an_sp_job_in_the_same_ranks_runs_the_trainers_ddp_step(sp_check):
    # accelerate leaves ACCELERATE_USE_DEEPSPEED set after an SP job: the next DDP job in the same
    # rank processes built a DeepSpeed plugin from it and ran DeepSpeed's engine instead of the
    # Trainer's DDP step (an ERROR now: the DDP step asserts it is not DeepSpeed's)
    sp = sp_check(CheckConfig(case="hf-trainer-sp-llama", world_size=2, train_step=True, micro_batches=2, steps=1,
                              timeout_s=TIMEOUT_S))
    if not runs_here(sp):
        return
    assert sp.verdict == PASS, format_result(sp)
    res = sp_check(CheckConfig(case="hf-trainer-llama", world_size=2, dp=2, train_step=True, micro_batches=2,
                               steps=1, timeout_s=TIMEOUT_S))
    assert res.verdict == PASS, format_result(res)
