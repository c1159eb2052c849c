"""Sharding metadata that contradicts a param's shape is a finding, not a crash (issue 62, item 3).

A param the case or its framework declares replicated whose local shape is a TP chunk of the
reference's is mapped by its shape where the shapes say it unambiguously (one dim differs, local x
TP = the reference's), the contradiction reported by name as a finding, and the check judges on:
a step that believes the metadata (a clip norm counting the param on TP rank 0 alone, as
megatron's does for its unflagged attention sinks) FAILs at the grad norm naming it. Where the
shapes cannot say which piece a param is, one line names it and the CLI exits 2 before anything is
judged. tests/param_metadata_cases.py holds the cases; megatron's own sinks:
tests/test_megatron_releases.py."""

import os
import subprocess
import sys

import pytest
import torch

from sp_harness.checks import side_by_side, train_step
from sp_harness.config.case import ParamMappingError, ParamSpec, by_shape, split_dim_by_shape
from sp_harness.config.check_config import CheckConfig
from sp_harness.report.result_text import format_result
from sp_harness.step.params import checked_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = os.path.join(os.path.dirname(__file__), "param_metadata_cases.py")
FINDING = "up.bias: local (16,) of (32,) but declared replicated; mapped by its shape as a contiguous TP chunk of dim 0"
CLIP = 0.01
"""Far below the grad norm at init: clipping is active at every step."""


class _Ctx:
    def __init__(self, tp: int, tp_rank: int = 0):
        self.tp, self.tp_rank = tp, tp_rank


# ------------------------------------------------------------------ the rule, without ranks

def test_one_dim_that_is_a_tp_chunk_is_read_off_the_shapes():
    assert split_dim_by_shape("w", (16, 8), (32, 8), 2, "declared replicated") == 0
    assert split_dim_by_shape("w", (8, 8), (8, 32), 4, "declared replicated") == 1
    spec = by_shape("sinks", (2,), (4,), 2, "not flagged tensor-parallel")
    assert spec.dim == 0 and not spec.replicated_tp
    assert spec.finding == ("sinks: local (2,) of (4,) but not flagged tensor-parallel; mapped by its shape as a "
                            "contiguous TP chunk of dim 0")


@pytest.mark.parametrize("local, whole, tp, why", [
    ((16, 4), (32, 8), 2, "2 dims differ"),
    ((12, 8), (32, 8), 2, "dim 0 is 12 of 32, not 1/2"),
    ((16,), (32, 8), 2, "1 dims against 2"),
    ((16, 8), (32, 8), 1, "no TP group"),
])
def test_shapes_that_do_not_say_where_a_param_lives_are_one_line_naming_it(local, whole, tp, why):
    with pytest.raises(ParamMappingError) as err:
        split_dim_by_shape("layer.w", local, whole, tp, "declared replicated")
    message = str(err.value)
    assert "\n" not in message and message.startswith("param layer.w: ") and why in message, message
    assert isinstance(err.value, ValueError)  # the CLI's user error: one line, exit 2


def test_a_declared_mapping_that_fits_the_shape_is_kept_and_one_that_does_not_is_read_off_it():
    kept = ParamSpec(ref_name="w", dim=0)
    assert checked_spec(kept, torch.Size([16, 8]), torch.Size([32, 8]), _Ctx(2, 1)) is kept
    # declared split on the wrong dim: the shape says dim 1
    moved = checked_spec(ParamSpec(ref_name="w", dim=0), torch.Size([32, 4]), torch.Size([32, 8]), _Ctx(2))
    assert moved.dim == 1 and "declared split on dim 0 (a piece (16, 8))" in moved.finding, moved.finding
    # a strided index view of another shape but the local element count is the framework's own layout
    index = ParamSpec(ref_name="w", index=lambda full: full.unflatten(0, (2, 16)).narrow(1, 0, 8))
    assert checked_spec(index, torch.Size([16, 8]), torch.Size([32, 8]), _Ctx(2)) is index
    with pytest.raises(ParamMappingError, match="index selects"):
        checked_spec(index, torch.Size([8, 8]), torch.Size([32, 8]), _Ctx(2))


# ------------------------------------------------------------------ on real ranks

def _config(name: str, **fields) -> CheckConfig:
    return CheckConfig(case=f"{CASES}:{name}", **{"world_size": 2, **fields})


def test_a_tp_chunk_declared_replicated_is_mapped_by_shape_reported_and_judged(sp_pool):
    res = side_by_side.check(_config("LYING"), sp_pool)
    assert res.verdict == "PASS", format_result(res)
    assert res.findings == [FINDING], res.findings
    assert res.to_json()["findings"] == [FINDING]
    assert f"finding (mapped by shape, judged): {FINDING}" in format_result(res)
    # judged as the chunk it is: its grads and updates were compared, not skipped
    assert res.num_checks > 0 and not res.drift


@pytest.mark.parametrize("name, verdict", [("LYING_STEP", "FAIL"), ("HONEST_STEP", "PASS")])
def test_a_step_that_believes_the_metadata_fails_at_the_grad_norm_naming_the_param(sp_pool, name, verdict):
    res = train_step.check(_config(name, optimizer="sgd", clip_grad_norm=CLIP, micro_batches=2, steps=1), sp_pool)
    assert res.verdict == verdict, format_result(res)
    if verdict == "PASS":
        assert res.findings == [], res.findings
        return
    assert res.first_check == "grad_norm", format_result(res)
    # the norm's composition names the param whose shards it left out
    assert res.worst["grad_norm"].name == "up.bias in the norm", format_result(res)
    assert "grad_norm:up.bias in the norm" in res.failing_names, res.failing_names
    assert res.findings == [FINDING], res.findings


def test_a_param_its_shape_cannot_place_is_one_line_before_anything_is_judged(sp_pool):
    with pytest.raises(ParamMappingError) as err:
        side_by_side.check(_config("UNEVEN"), sp_pool)
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"case {CASES}:UNEVEN: param up.weight: local (12, 8) of the reference's (32, 8), "
                              "but declared replicated"), message
    assert "not 1/2 (TP 2)" in message and "declare its split" in message, message


@pytest.mark.exhaustive("the fast tier raises the same error from the check (the CLI maps every ValueError to exit 2)")
def test_the_cli_says_that_line_and_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "SP_HARNESS_MAX_WORLD_SIZE"}
    proc = subprocess.run([sys.executable, "-m", "sp_harness.cli", "check", "--case", f"{CASES}:UNEVEN",
                           "--world-size", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("sp-harness: error: case ") and "param up.weight: local (12, 8)" in lines[0], lines[0]
