"""Stage: compare. The coherent scale of a low-precision param grad piece, pure.

The ensemble's norm-wise bound (sp_harness.compare.tolerance) lets a piece's error norm reach
F(m) times the members' largest: at m = 24 degrees of freedom F is about 3, so a grad scaled by
1 + d passes until d is several times the piece's relative rounding noise (d = 0.056 at the
default config in bfloat16). A scaled grad is coherent, though: its error is d G, along the
exact grad G itself, where rounding noise spreads over many directions. Projected on G,

    beta = <E, G> / |G|^2,        E = got - G (the float64 reference's piece),

a scaled grad has beta = d while the noise contributes a standard error of only

    se = sqrt(share / (1 - share)) |E - beta G| / |G|,

where `share` = G^T C G / (tr C |G|^2) is the fraction of the noise's variance that lies along G,
from the same per-token model that gives the piece's degrees of freedom
(sp_harness.compare.dof.weight_grad_dof: C = sum_t diag(g_t^2) (x) x_t x_t^T + g_t g_t^T
(x) diag(x_t^2)), and |E - beta G|^2 is the piece's own residual, whose expectation is
(1 - share) tr C under the model: the run's own noise scales its own standard error, so a
sharded run that rounds more than the references gets a wider band, not a false alarm.
`piece_noise` derives `share` on the reference side, where the terms are; only the number
travels.

Correct implementations are not all at beta = 0: a scalar they multiply every token's grad by
(the loss's 1 / tokens) is rounded once in the run dtype, and a sharded loss may round its own
normaliser differently (per rank, then across ranks). The members carry the reference's, so the
run must lie within the band between 0 and MISMATCH times their mean bias b (b = mean_k beta_k),
widened by SCALAR_ROUNDINGS unit roundoffs u either way and by t(nu) standard errors:

    beta_run on b's side:   |beta_run| <= MISMATCH |b| + SCALAR_ROUNDINGS u + t(nu) sqrt(se_run^2 + MISMATCH^2 se_b^2)
    on the other side:      |beta_run| <= SCALAR_ROUNDINGS u + t(m) se_run

(`GradScaleBound`), with t(nu) the two-sided 1e-5 quantile of Student's t at the Satterthwaite
degrees of freedom of the variance estimates (the run's residual has about m, the piece's derived
degrees of freedom, each member's as many): the same 1e-5 per piece as the norm-wise bound's chi
ratio.

Recorded, not judged (TensorCheck.scale_ratio). The model holds where a Linear's output grads
err token by token (an MLP's, a norm's): there the members' coherent errors differ by what it
predicts or less. An attention's key projection breaks it: each key's grad sums every query's
softmax-backward term P_qt (dP_qt - D_q), so one error in a query's row sum moves every key's grad
along the same part of it, a coherent error across the keys, and correct implementations differ
in it (bfloat16 megatron-gpt-sp, 4 ranks, hidden 84, 4 layers, `--seed 124`: a correct run's
k-proj grad at beta 0.024 +- 0.0017 where both members sit at 0.0065, 0.87 of its band). Judged,
it would have caught one rank's fc1 grad scaled by 3.2% at the default config (from 5.6%) and
1.1% at the training-like size (from 2.3%); docs/tolerance.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sp_harness.compare.update_scale import scale_ratio

MISMATCH = 1.5
"""How far past the members' largest coherent error a correct run's may sit (as the norm-wise
bound's MISMATCH: a run may round a fused op's parts that no member rounds)."""
SCALAR_ROUNDINGS = 2.0
"""Unit roundoffs of coherent scale a correct run may carry that the members do not: the loss's
normaliser rounded in the run dtype, once per rank and once across ranks."""
MAX_SHARE = 0.5
"""A piece whose noise lies this much or more along G (a handful of elements, one token) has no
residual to estimate its noise from: not judged this way."""
T_QUANTILE = ((4, 27.8), (6, 13.6), (8, 9.78), (12, 7.26), (16, 6.33), (24, 5.57), (32, 5.24), (48, 4.94),
              (64, 4.80), (128, 4.60), (256, 4.51), (1024, 4.44))
"""(nu, t): the two-sided 1e-5 quantile of Student's t with nu degrees of freedom (mpmath's
regularized incomplete beta, bisected; tests/test_grad_scale.py recomputes it); 4.42 is the
normal's."""
NORMAL_QUANTILE = 4.417


@dataclass(kw_only=True, frozen=True)
class PieceNoise:
    """What the float64 reference derives for one Linear or norm grad piece from its per-token
    terms (a share of 1: no scale, as for a key projection's, `sums_to_zero`)."""

    dof: float
    """Degrees of freedom of the piece's rounding error norm (dof.weight_grad_dof)."""
    share: float
    """The fraction of that error's variance along the exact grad G: G^T C G / (tr C |G|^2)."""
    cancellation: float = float("inf")
    """A Linear weight piece's per-token terms' root sum of squares over the sum they make,
    `sqrt(sum_t |g_t|^2 |x_t|^2) / |G|` (tolerance.NO_CANCELLATION): about 1 where the tokens'
    outer products add in general position, large where they cancel. inf: not derived (a bias,
    a norm's param), which keeps the perturbed reference's term."""


@dataclass(kw_only=True, frozen=True)
class GradScale:
    """One tensor's coherent relative error along a piece's exact grad."""

    beta: float
    """<E, G> / |G|^2: the tensor is G (1 + beta) plus noise orthogonal to nothing in particular."""
    se: float
    """beta's standard error, from the tensor's own residual."""


@dataclass(kw_only=True, frozen=True)
class GradScaleBound:
    """The run's coherent grad scale against the band the members and legal roundings span."""

    run: GradScale
    allowed: float
    """The largest |beta_run| on the run's side of 0 (see grad_scale_bound)."""

    @property
    def ratio(self) -> float:
        return scale_ratio(self.run.beta, self.allowed)


def t_quantile(nu: float) -> float:
    """T_QUANTILE at `nu`, linear in log(nu) between its rows, the normal's beyond them."""
    table = T_QUANTILE
    if nu <= table[0][0]:
        return table[0][1]
    for (n0, q0), (n1, q1) in zip(table, table[1:], strict=False):
        if nu <= n1:
            t = (math.log(nu) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return q0 + t * (q1 - q0)
    return NORMAL_QUANTILE


def weight_share(x: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, trace: float) -> float:
    """`share` of a weight grad piece `grad` (rows, cols) = sum_t g_t x_t^T, from its tokens'
    inputs `x` (S, cols) and output grads `g` (S, rows): every token, or an evenly strided sample
    whose tr C over the same tokens is `trace` (2 sum_t |g_t|^2 |x_t|^2 over all of them, scaled
    by S / T). The larger of weight_shares' two: real errors mix them in unknown proportions, and
    the mix's share lies between them."""
    return max(weight_shares(x, g, grad, trace))


def weight_shares(x: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, trace: float) -> tuple[float, float]:
    """(elementwise, per-token) shares of a weight grad piece (arguments as weight_share's):
    under elementwise errors G^T C G = sum_t sum_i g_ti^2 (G x_t)_i^2 + sum_j x_tj^2 (G^T g_t)_j^2;
    under per-token scalar ones (a token's normaliser rounded: its g_t or x_t off by one factor)
    it is 2 sum_t (g_t . G x_t)^2, for the same tr C."""
    grad = grad.to(torch.float64)
    x, g = x.to(torch.float64), g.to(torch.float64)
    gx = x @ grad.T  # (S, rows): G x_t
    grad_sq = float(grad.square().sum())
    elementwise = float((g.square() * gx.square()).sum() + (x.square() * (g @ grad).square()).sum())
    per_token = 2.0 * float((g * gx).sum(1).square().sum())
    return _share(elementwise, trace, grad_sq), _share(per_token, trace, grad_sq)


def bias_share(variances: torch.Tensor, grad: torch.Tensor, g: torch.Tensor | None = None) -> float:
    """`share` of a bias grad piece `grad` whose elements err independently with `variances`
    (S_i = sum_t g_ti^2), or, where its tokens' output grads `g` (T, rows) are given, per token
    by one factor (the larger of the two, as weight_share)."""
    grad = grad.to(torch.float64)
    along = float((variances * grad.square()).sum())
    if g is not None:
        along = max(along, float((g.to(torch.float64) @ grad).square().sum()))
    return _share(along, float(variances.sum()), float(grad.square().sum()))


def norm_weight_share(dy: torch.Tensor, xhat: torch.Tensor, grad: torch.Tensor) -> float:
    """`share` of an elementwise-affine norm's weight grad piece `grad` = sum_t dy_t * x^_t, from
    its tokens' output grads `dy` and normalised inputs `xhat` (T, width) at the piece's
    elements. Elementwise errors in both leave its elements independent, of variance V_i =
    2 sum_t dy_ti^2 x^_ti^2: G^T C G = sum_i V_i G_i^2; per-token scalar ones (dy_t or x^_t off
    by one factor) give 2 sum_t (sum_i dy_ti x^_ti G_i)^2 for the same tr C = sum V. The larger."""
    dy, xhat, grad = dy.to(torch.float64), xhat.to(torch.float64), grad.to(torch.float64)
    w = dy * xhat  # (T, width): each token's term
    variances = w.square().sum(0)
    grad_sq = float(grad.square().sum())
    along = max(float((variances * grad.square()).sum()), float((w @ grad).square().sum()))
    return _share(along, float(variances.sum()), grad_sq)


CANCELLED = 1e-12
"""A row of a Linear's output grads whose sum over tokens is below this fraction of its sum of
squares (in float64) sums to zero in exact arithmetic: a softmax's keys (shift invariance)."""
CANCELLED_MASS = 0.01


def sums_to_zero(g: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether a Linear's output grads `g` (T, rows) sum to zero over the tokens (CANCELLED) in
    rows that carry more than CANCELLED_MASS of its grad piece `grad` (rows, ...): an
    attention's key projection, whose grads the coherent-scale model does not cover. Each key's
    grad sums every query's P_qt (dP_qt - D_q), whose sum over keys is zero, so an error in a
    query's row sum D_q moves every key's grad coherently, and correct implementations differ in
    it (docs/tolerance.md, "The coherent grad scale")."""
    if not g.numel() or not grad.numel():
        return False  # an empty piece (a rank holding none of a one-unit layer's rows)
    g = g.to(torch.float64)
    cancelled = g.sum(0).square() <= CANCELLED * g.square().sum(0)
    mass = grad.to(torch.float64).square().reshape(g.shape[1], -1).sum(1)
    return bool(mass[cancelled].sum() > CANCELLED_MASS * mass.sum())


def _share(along: float, trace: float, grad_sq: float) -> float:
    if trace <= 0 or grad_sq <= 0:
        return 1.0
    return min(1.0, along / (trace * grad_sq))


def grad_scale(err: torch.Tensor, grad: torch.Tensor, share: float) -> GradScale:
    """`err` (a tensor's piece minus the float64 one, `grad`)'s coherent scale along `grad`."""
    err, grad = err.to(torch.float64).reshape(-1), grad.to(torch.float64).reshape(-1)
    grad_sq = float(grad.square().sum())
    beta = float(err @ grad) / grad_sq
    residual = float((err - beta * grad).square().sum())
    return GradScale(beta=beta, se=math.sqrt(share / (1 - share) * residual / grad_sq))


def grad_scale_bound(*, err: torch.Tensor, member_errs: Sequence[torch.Tensor], grad: torch.Tensor,
                     noise: PieceNoise, dtype: torch.dtype) -> GradScaleBound | None:
    """The run's coherent grad scale (its error `err`) against the members' (`member_errs`),
    or None where the piece cannot be judged this way (no members, noise mostly along G, a
    zero grad).

    Correct runs sit between 0 (the exact grad's scale) and MISMATCH times the members' mean
    bias b (estimated by their mean, with its standard error), widened by SCALAR_ROUNDINGS unit
    roundoffs either way. On the side away from b only the run's own noise adds; on b's side
    MISMATCH x b's estimate's too."""
    if not member_errs or noise.share >= MAX_SHARE or not bool(grad.any()):
        return None
    run = grad_scale(err, grad, noise.share)
    members = tuple(grad_scale(e, grad, noise.share) for e in member_errs)
    # the run's residual has about m degrees of freedom, each member's too
    return scale_band(run=run, members=members, dof=max(noise.dof * (1 - noise.share), 1.0), dtype=dtype)


def scale_band(*, run: GradScale, members: Sequence[GradScale], dof: float, dtype: torch.dtype) -> GradScaleBound:
    """`run`'s coherent scale against the band between 0 and MISMATCH x the members' mean
    (grad_scale_bound's), each standard error estimated with `dof` degrees of freedom."""
    num_members = len(members)
    bias = sum(m.beta for m in members) / num_members
    bias_var = sum(m.se ** 2 for m in members) / num_members ** 2
    m = dof
    run_var = run.se ** 2
    toward_bias = (run.beta >= 0) == (bias >= 0)
    edge = SCALAR_ROUNDINGS * torch.finfo(dtype).eps / 2
    if toward_bias:
        edge += MISMATCH * abs(bias)
        spread = (MISMATCH ** 2) * bias_var
        total = run_var + spread
        # Satterthwaite over the run's and the members' variance estimates
        nu = total ** 2 / (run_var ** 2 / m + spread ** 2 / (num_members * m)) if total > 0 else m
    else:
        total, nu = run_var, m
    allowed = edge + t_quantile(nu) * math.sqrt(total)
    return GradScaleBound(run=run, allowed=allowed)
