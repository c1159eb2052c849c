"""Stage: step. How a run in each dtype is judged: one `Precision` record per run dtype, holding
every rule of the tolerance model that depends on the dtype. The references
(sp_harness.checks.references), the order-error adversary (sp_harness.step.adversary), the
tolerance model (sp_harness.compare.tolerance) and the checks' rank jobs read these records and
test no dtype themselves, so changing how one dtype is judged is changing its record here (plus
tests). The rules' reasons and evidence: docs/tolerance.md, "Per dtype".

Lives in `step/`, the lowest stage that reads it (the adversary's order error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """What a matmul or sum of `dtype` tensors accumulates in: float32 below float32 (what CPU
    kernels and tensor cores do: bfloat16 and float16 products are exact in float32 and summed
    there), else the dtype itself. For any op's inputs, not only a run's dtype (an island's)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass(kw_only=True, frozen=True)
class Precision:
    """Every dtype-dependent rule of judging a run in `dtype`."""

    dtype: torch.dtype
    """The run dtype."""
    reference: torch.dtype
    """The precision of the run-precision reference ('lp'): the run dtype, except float32 for
    a float64 run (a float32 proxy, its error scaled by eps64 / eps32: the run cannot be
    computed more precisely to measure it)."""
    members: tuple[str, ...]
    """The ensemble's extra references ('rounded': the model at `member_dtype` with every op's
    result rounded to the run dtype, sp_harness.step.rounding.RoundedResults). Where there are
    members, they and 'lp' bound the norm of forward outputs, LSEs, grads and input grads
    (tolerance.ENSEMBLE_KINDS), pieces whose bounds would pass a zero tensor are withheld
    (tolerance.vacuous) and a forward output's coherent scale is judged
    (sp_harness.compare.output_scale): below float32 only, where the run's own roundings
    dominate and a member can model them (docs/tolerance.md, "The ensemble bound")."""
    member_dtype: torch.dtype | None
    """The precision the members compute in before each rounding to the run dtype (None: no
    members)."""
    alt_member_kinds: frozenset[str]
    """Checks whose norm-wise bound also tries a two-member ensemble, the run-precision and the
    perturbed references, taking the smaller of it and the two-reference bound (NORM_FACTOR):
    float32's forward outputs and LSEs. Never its grads: a sharded attention's backward (a
    flash-style row sum, partial dK / dV summed over ranks) rounds what neither member does.
    float64 keeps the two-reference bound: its run-precision reference is another process
    (docs/tolerance.md, "The ensemble bound")."""
    order_noise: bool
    """Whether the run-precision reference carries a random summation-order error
    (sp_harness.checks.references.platform_noise). Not below float32: its accumulator (float32)
    errs 1e-4 of the run's own rounding of each result, not worth a matmul per matmul."""
    walk: bool
    """The order error's model (sp_harness.step.adversary.order_error): the worst-order walk
    (True) or a sequential kernel's error (False: float32; 1.3-1.5x a naive float32 loop's
    error where the walk is 27x, tests/test_tolerance_parts.py, so 2-10x sharper, docs/sensitivity.md).
    float64 walks: its run-precision reference is a float32 proxy, which on `default` kernels
    accumulates in double (a ring-gpt draw at 1.17x under the sequential model). Immaterial
    below float32 (`order_noise`)."""
    magnitude: torch.dtype | None
    """The dtype the perturbed reference's |A| @ |B| is formed in: float32 for runs of float32
    or less (they cannot hold what would overflow it), None (float64) above."""
    update_scale: bool
    """Whether a param of this dtype has its coherent update scale judged after the optimizer
    step (sp_harness.compare.update_scale) beside the elementwise bound: bfloat16 only; float32
    and float64's elementwise bound already sees 1e-6 relative (docs/sensitivity.md)."""

    step_dtype: torch.dtype
    """What the training-step check models a step whose optimizer cannot be read keeping its
    master params and state in (the shadow optimizer: sp_harness.step.shadow). The run dtype
    itself. The grad norm's sum of squares is modelled in `accumulator` (float32 below float32,
    as frameworks sum it), with the run dtype's roundings of its scalar steps on top
    (docs/tolerance.md, "The training-step check's bounds")."""

    @property
    def accumulator(self) -> torch.dtype:
        """What its matmuls and sums accumulate in (`accumulator`): the unit roundoff of the
        perturbed reference's order error."""
        return accumulator(self.dtype)


FLOAT64 = Precision(dtype=torch.float64, reference=torch.float32, members=(),
                    member_dtype=None, alt_member_kinds=frozenset(), order_noise=True, walk=True, magnitude=None,
                    update_scale=False, step_dtype=torch.float64)
FLOAT32 = Precision(dtype=torch.float32, reference=torch.float32, members=(),
                    member_dtype=None, alt_member_kinds=frozenset({"forward", "lse"}), order_noise=True, walk=False,
                    magnitude=torch.float32, update_scale=False, step_dtype=torch.float32)
BFLOAT16 = Precision(dtype=torch.bfloat16, reference=torch.bfloat16, members=("rounded",),
                     member_dtype=torch.float32, alt_member_kinds=frozenset(), order_noise=False, walk=True,
                     magnitude=torch.float32, update_scale=True, step_dtype=torch.bfloat16)

PRECISIONS: dict[torch.dtype, Precision] = {p.dtype: p for p in (FLOAT64, FLOAT32, BFLOAT16)}
"""Run dtype -> its record. float16 is not a run dtype yet: its AdamW needs loss scaling (v
underflows for grads below about 1e-2)."""


def precision_of(dtype: torch.dtype) -> Precision:
    """The record of a run in `dtype`."""
    if dtype not in PRECISIONS:
        valid = ", ".join(str(d).removeprefix("torch.") for d in PRECISIONS)
        raise ValueError(f"dtype {str(dtype).removeprefix('torch.')} is not a run dtype (valid: {valid})")
    return PRECISIONS[dtype]
