"""megatron-core's release range and the shipped bug its release case catches, on the installed
release (the default suite: the pinned 0.16.1; the release matrix, `tox -m releases-megatron`: each
env's).

- `release-mcore-7452-f8-sinks-clip-norm`: learnable attention sinks (`softmax_type="learnable"`)
  as megatron builds them: `softmax_offset` holds this rank's heads but is not flagged
  tensor-parallel. The param mapping reads it off its shape and says so (a finding, not a crash);
  megatron's own training step then FAILs at the grad norm naming it, since its norm counts TP rank
  0's sinks alone (NVIDIA/Megatron-LM#7452 finding 8). The side-by-side check PASSes: the grads
  themselves are right.
- `mcore-gpt-sp-step-sinks`, its control: the sinks flagged as the fix does (PR #7530), PASS.
"""

import pytest
from installed import skip_unless_installed

skip_unless_installed("megatron.core", "megatron-core is not installed (pip install -e '.[megatron]')")

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.config.registry import get_case  # noqa: E402
from sp_harness.judge.expect import expected_verdict  # noqa: E402
from sp_harness.report.result_text import format_result  # noqa: E402

RELEASE = "release-mcore-7452-f8-sinks-clip-norm"
CONTROL = "mcore-gpt-sp-step-sinks"
SINKS = ("decoder.layers.0.self_attention.core_attention.softmax_offset",
         "decoder.layers.1.self_attention.core_attention.softmax_offset")
TIMEOUT_S = 180.0
"""Generous for a loaded runner; megatron-core's import is the case's setup, outside it."""


def _example(name: str, **fields) -> CheckConfig:
    return get_case(name).examples[0].config(name).replace(timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("name", ["release-mcore-7452-f8-sinks-clip-norm", "mcore-gpt-sp-step-sinks"])
def test_unflagged_sinks_fail_at_the_grad_norm_by_name_and_flagged_ones_pass(sp_check, name):
    config = _example(name)
    res = sp_check(config)
    expected = expected_verdict(config)
    assert res.verdict == expected, format_result(res)
    if name == CONTROL:  # flagged as PR #7530 flags them: nothing to report, every stage within its bound
        assert expected == "PASS" and res.findings == [], format_result(res)
        return
    # a finding for each layer's sinks, by name, whichever the verdict: megatron's metadata says replicated
    assert [f.split(":")[0] for f in res.findings] == list(SINKS), res.findings
    assert all("local (2,) of (4,) but not flagged tensor-parallel" in f for f in res.findings), res.findings
    if expected == "FAIL":
        assert res.first_check == "grad_norm", format_result(res)
        assert res.failures[0].name == f"{SINKS[0]} in the norm", res.failures[0].describe()


@pytest.mark.exhaustive("the training-step check above judges the same model's grads (before clipping) too")
def test_the_side_by_side_check_passes_the_unflagged_sinks_with_the_finding(sp_check):
    res = sp_check(_example(RELEASE, train_step=False, clip_grad_norm=None, micro_batches=None))
    assert res.verdict == "PASS", format_result(res)
    assert len(res.findings) == len(SINKS), res.findings
