"""Each run dtype's judging rules have one home, its `Precision` record
(sp_harness.step.precision): every run dtype has one, the records are consistent with what the
references can compute, and no judging module tests a run dtype itself. Pure: no process group."""

import re
import typing
from pathlib import Path

import pytest
import torch

from sp_harness.checks.references import KINDS, SAMPLES, kinds_for
from sp_harness.compare.tolerance import ENSEMBLE_KINDS
from sp_harness.config.check_config import DTYPES, DType
from sp_harness.step.precision import PRECISIONS, accumulator, precision_of

ROOT = Path(__file__).resolve().parents[1]

JUDGING = ("harness/compare", "harness/checks", "harness/step", "harness/judge", "harness/train")
"""Where the tolerance model and the checks live: a run dtype's rule there belongs in its record."""
DTYPE_TEST = re.compile(r"(==|!=|\bin\b) *\(?torch\.(float64|float32|bfloat16|float16)\b|finfo\([^)]*\)\.bits")
ALLOWED = {
    # TF32 rounds float32 matmul inputs only: a platform fact about tensors, not a judging rule
    ("harness/checks/references.py", "if config.torch_dtype != torch.float32:"),
    ("harness/step/adversary.py", "if x.dtype != torch.float32:"),
    ("harness/step/adversary.py", "if self.tf32 and dtype == torch.float32:"),
    # the rounding mode rounds results finer than the run dtype, whatever they are
    ("harness/step/rounding.py", "and torch.finfo(out.dtype).bits > torch.finfo(self.dtype).bits):"),
}


def test_every_run_dtype_has_a_record():
    assert set(PRECISIONS) == {DTYPES[name] for name in typing.get_args(DType)}
    for dtype, precision in PRECISIONS.items():
        assert precision.dtype == dtype
        assert precision_of(dtype) is precision


def test_a_dtype_that_is_not_a_run_dtype_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"dtype float16 is not a run dtype \(valid: float64, float32, bfloat16\)"):
        precision_of(torch.float16)


def test_records_ask_only_for_what_the_references_compute():
    for precision in PRECISIONS.values():
        assert set(precision.members) <= set(SAMPLES)
        assert (precision.member_dtype is None) == (not precision.members)
        assert precision.alt_member_kinds <= ENSEMBLE_KINDS
        assert kinds_for(precision.dtype) == KINDS + precision.members
        assert precision.accumulator == accumulator(precision.dtype)
        # the run-precision reference measures the run's error: never finer than float32
        assert torch.finfo(precision.reference).bits <= 32


def test_no_judging_module_tests_a_run_dtype_outside_its_record():
    found = set()
    for folder in JUDGING:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "harness/step/precision.py":
                continue
            for line in path.read_text().splitlines():
                if DTYPE_TEST.search(line):
                    found.add((rel, line.strip()))
    assert found <= ALLOWED, (f"a dtype test outside sp_harness.step.precision: {sorted(found - ALLOWED)}; "
                              f"put the rule in the dtype's Precision record")
