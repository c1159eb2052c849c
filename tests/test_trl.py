"""TRL's SFTTrainer (sp_harness.cases.frameworks.trl): its own dataset preparation, collator,
completion-only labels and fused-LM-head loss inside the transformers Trainer's loop, on real gloo
ranks, against the same HF model in float64 on one device over the whole global batch.

- DDP (DP 2, K=3, the last micro-batch empty by design): the SFTTrainer's own loss PASSes.
- accelerate's SP (DP 2 x SP 2, DeepSpeed's Ulysses, ZeRO-1) with a user's token-mean fix over
  TRL's fused head PASSes in float32 and bfloat16; the SFTTrainer as shipped there hands its loss
  to the Trainer's SP loss and FAILs at the reported loss (the release case).
- The mutants are killed in test_mutants (the count divided by SP at train-step-sp, the prompt
  trained on at train-step-dp), their correct twins passing there: the fast tier's float32 PASS of
  both steps; the fast tier's bfloat16 SP PASS is here, the other PASS tests are the full tier's."""

import pytest
from installed import skip_unless_installed

skip_unless_installed("trl", "trl is not installed (pip install -e '.[trl]')")
skip_unless_installed("deepspeed", "deepspeed is not installed (pip install -e '.[deepspeed]')")

from hf_sp_path import TIMEOUT_S, runs_here, sp_config  # noqa: E402

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS  # noqa: E402
from sp_harness.report.result_text import format_result  # noqa: E402


@pytest.mark.exhaustive("test_mutants runs trl-sft-llama as the prompt-trained mutant's twin (train-step-dp: DP 2, "
                        "K=3, SGD with clipping, float32); the main job checks that config")
@pytest.mark.parametrize("fields", [dict(optimizer="sgd", clip_grad_norm=0.01, dtype="float32"),
                                    dict(optimizer="adamw", dtype="bfloat16")], ids=["f32-sgd-clip", "bf16-adamw"])
def test_the_sft_trainers_own_ddp_step_passes(sp_check, fields):
    res = sp_check(CheckConfig(case="trl-sft-llama", world_size=2, dp=2, train_step=True, micro_batches=3, steps=2,
                               timeout_s=TIMEOUT_S, **fields))
    assert res.verdict == PASS, format_result(res)
    assert {"loss", "grad", "grad_norm", "param"} <= set(res.worst), set(res.worst)


FLOAT32_TWIN = ("test_mutants runs trl-sft-sp-llama as the SP mutant's twin (train-step-sp: DP 2 x SP 2, SGD with "
                "DeepSpeed's clipping, float32); the fast tier runs bfloat16 AdamW here")


@pytest.mark.parametrize("fields", [pytest.param(dict(dtype="float32"), marks=pytest.mark.exhaustive(FLOAT32_TWIN)),
                                    dict(dtype="bfloat16"),
                                    pytest.param(dict(optimizer="sgd", clip_grad_norm=0.01),
                                                 marks=pytest.mark.exhaustive(FLOAT32_TWIN))],
                         ids=["f32-adamw", "bf16-adamw", "f32-sgd-clip"])
def test_the_sft_trainers_sp_step_with_a_token_mean_fix_passes(sp_check, fields):
    res = sp_check(sp_config("trl-sft-sp-llama", **fields))
    if not runs_here(res, scaled_loss=True):
        return
    assert res.verdict == PASS, format_result(res)
    assert {"loss", "grad", "grad_norm", "param"} <= set(res.worst), set(res.worst)


def test_the_sft_trainer_as_shipped_under_sp_fails_at_the_reported_loss(sp_check):
    res = sp_check(sp_config("release-trl-sft-sp-mean-of-means-times-sp"))
    if not runs_here(res):
        return
    assert res.verdict == FAIL and res.first_check == "loss", format_result(res)
    assert any(f.kind == "grad" for f in res.failures)
