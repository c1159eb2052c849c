"""Stage: compare. The update-scale statistic of a low-precision optimizer step, pure.

The elementwise optimizer bound (sp_harness.step.optim_ref) must hold for every element's worst
case, and in bfloat16 that worst case is most of the update: a step scaled by 1.06 passes it.
A scaled step is coherent, though: every element moves the same relative amount along its own
update. The final rounding to the parameter's dtype dithers that shift, so it can be estimated
over the whole piece (the way a dithered ADC resolves below its step):

    a_i = (p64'_i - p_i) / ulp_i          the exact step (float64, from the run's own state),
    d_i = (x_i - fl(p64'_i)) / ulp_i      x's departure from the correctly rounded step,

both in units of the parameter dtype's spacing at fl(p64'_i). A step x = p + (1 + beta)(p64' - p)
plus rounding has d_i = beta a_i + noise, so each element's r_i = d_i / a_i estimates beta, with
variance (1/6 + (c u a_i)^2) / a_i^2: the final rounding's dither (the run's and fl(exact)'s,
uniform, 1/12 ulp^2 each) plus the update's own roundings (c = UPDATE_ROUNDINGS unit roundoffs
of it). Weighted by the inverse of that,

    beta = sum(w r) / sum(w),  se = sqrt(sum(w^2 (r - beta)^2)) / sum(w),  w = a^2 / (1/6 + (c u a)^2)

estimates the step's coherent relative error, with a standard error taken from the same piece's
residuals (HC0). A step that stagnates (|a| < 1/2 everywhere) carries no information, and no
element weighs more than 1 / (c u)^2, so a parameter much smaller than its step (where d / a is
just the update's own rounding) cannot carry the estimate.

Correct implementations are not at beta = 0. The fused one (the step in float32, rounded once)
is; one that rounds every intermediate in the run dtype (torch's AdamW or SGD on bfloat16
tensors) has a coherent error of its own, up to 0.4 unit roundoffs of the update at AdamW's
first step (tests/test_update_scale.py), where every element's update has the same magnitude.
That member is computed from the very state the run stepped from
(sp_harness.step.optim_ref.member_step), so its beta is measured, not fitted. The run's beta
must lie within

    |beta_run| <= MISMATCH * |beta_member| + Z * sqrt(se_run^2 + se_member^2)

(`ScaleBound`): the legal implementations span [0, beta_member], MISMATCH gives a partly fused
kernel half as much again, and Z = 5 standard errors of two independent dithered estimates: a
two-sided normal tail of 6e-7 per piece, 1e-4 over the few hundred pieces of a check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Z = 5.0
"""Standard errors the run's slope may sit beyond the band of correct implementations."""
MISMATCH = 1.5
"""How far past the unfused member's coherent error a partly fused kernel may sit."""
UPDATE_ROUNDINGS = 2.0
"""The rms error of a correct update in unit roundoffs of it (its ~5 roundings, each uniform within
+-u, add to about 1.3 u in rms): caps the weight of an element whose step is many ulps of its
parameter, where d / a is the update's own relative rounding error and says nothing finer."""
MIN_ELEMENTS = 64
"""Fewer elements that move than this and the slope is not judged (its tail is not normal)."""
MAX_ELEMENTS = 1 << 16
"""A piece larger than this is judged on an evenly strided sample of about this many elements
(`sample`): a coherent scale moves every element, and at 65536 elements the standard error is
already a few 1e-5 (the training-size sensitivity, 0.0025, is set by the member's band), while
the statistic over every element of a realistic model cost a check a tenth of its time."""


@dataclass(kw_only=True, frozen=True)
class UpdateScale:
    """The coherent relative error of one piece's optimizer step."""

    beta: float
    """The step's estimated relative scale error (x = p + (1 + beta)(exact step))."""
    se: float
    """beta's standard error, from the piece's own residuals."""
    num_moving: int
    """Elements whose exact step is nonzero (the ones that carry information)."""


@dataclass(kw_only=True, frozen=True)
class ScaleBound:
    """The run's update scale against the band correct implementations span."""

    run: UpdateScale
    member: UpdateScale
    allowed: float
    """MISMATCH |member.beta| + Z sqrt(run.se^2 + member.se^2) (+ the step's slack)."""

    @property
    def ratio(self) -> float:
        return scale_ratio(self.run.beta, self.allowed)

    def describe(self) -> str:
        return (f"update scale: the step is x(1 {'+' if self.run.beta >= 0 else '-'} "
                f"{abs(self.run.beta):.3g}) +- {self.run.se:.2g} over {self.run.num_moving} elements, "
                f"allowed {self.allowed:.3g} (an unfused correct step's {self.member.beta:+.3g})")


def scale_ratio(beta: float, allowed: float) -> float:
    """|beta| / allowed, where an allowed 0 tolerates exactly 0."""
    if allowed == 0:
        return 0.0 if beta == 0 else math.inf
    return abs(beta) / allowed


def sample(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened, every k-th element, k the smallest stride leaving at most MAX_ELEMENTS."""
    flat = t.reshape(-1)
    return flat[:: max(1, math.ceil(flat.numel() / MAX_ELEMENTS))]


def _spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each |x| (float32 values of `dtype`): eps times 2^exponent, the
    exponent read from x's bits; subnormals at the smallest normal's."""
    info = torch.finfo(dtype)
    power = (x.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^exponent (0 for 0)
    return (power * info.eps).clamp_min(info.tiny * info.eps)


def update_scales(*, before: torch.Tensor, exact: torch.Tensor, gots: Sequence[torch.Tensor],
                  dtype: torch.dtype) -> list[UpdateScale]:
    """The coherent scale error of each of `gots`, the piece after a step in `dtype` from
    `before` whose exact (float64) result is `exact` (one pass over the shared terms). Only the
    step itself needs float64; the rest is exact or statistical in float32."""
    exact = exact.detach().to(torch.float64)
    rounded = exact.to(dtype).to(torch.float32)
    ulp = _spacing(rounded, dtype)
    a = (exact - before.detach().to(torch.float64)).to(torch.float32) / ulp
    moving = a != 0
    a = a[moving]
    u = torch.finfo(dtype).eps / 2
    # each element's relative error d / a, weighted by 1 / its variance: the final rounding's
    # dither (1/6 ulp^2: the run's and fl(exact)'s, uniform) over a^2, plus the update's own
    # roundings (UPDATE_ROUNDINGS unit roundoffs of it), so no element weighs more than those
    w = a * a / (1 / 6 + (UPDATE_ROUNDINGS * u * a) ** 2)
    sw = float(w.sum(dtype=torch.float64))
    out = []
    for got in gots:
        if not sw:
            out.append(UpdateScale(beta=0.0, se=0.0, num_moving=0))
            continue
        d = ((got.detach().to(torch.float32) - rounded) / ulp)[moving]  # exact: both are `dtype` values
        r = d / a
        beta = float((w * r).sum(dtype=torch.float64)) / sw
        se = math.sqrt(float((w * w * (r - beta) ** 2).sum(dtype=torch.float64))) / sw
        out.append(UpdateScale(beta=beta, se=se, num_moving=int(a.numel())))
    return out


def scale_bound(run: UpdateScale, member: UpdateScale, slack: float = 0.0) -> ScaleBound | None:
    """The bound, or None where the piece has too few moving elements to judge. `slack`: a relative
    uncertainty of the whole step's scale that the member cannot share (the clip coefficient the
    run computed itself, in its own precision)."""
    if run.num_moving < MIN_ELEMENTS:
        return None
    allowed = MISMATCH * abs(member.beta) + Z * math.hypot(run.se, member.se) + slack
    return ScaleBound(run=run, member=member, allowed=allowed)
