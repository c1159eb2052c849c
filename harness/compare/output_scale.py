"""Stage: compare. The coherent scale of a low-precision forward output piece, pure.

The ensemble's norm-wise bound lets a forward piece's error norm reach F(m) times the members'
largest, so one rank's logits scaled by 1 + d pass until d is a few times the piece's relative
rounding noise (d = 0.035 at the default config in bfloat16). A scaled output is coherent: its
error is d Y, along the exact output Y itself. Projected on Y, token by token,

    beta_t = <e_t, y_t> / |y_t|^2,     beta = sum_t w_t beta_t = <E, Y> / |Y|^2,   w_t = |y_t|^2 / |Y|^2,

a scaled piece has beta = d. Rounding errors are independent across tokens to first order
(each token's normaliser, its softmax row sums, its elementwise roundings are its own), while
within a token they may have any covariance: a per-token scalar (one rounded normaliser moves
the whole row along y_t) and elementwise noise alike. So beta's standard error is estimated
from the tokens' own spread, clustered by token (the sandwich estimator, HC1):

    se^2 = T / (T - 1) sum_t w_t^2 (beta_t - beta)^2,

with nu = (sum w_t^2)^2 / sum w_t^4 - 1 degrees of freedom (the effective number of tokens less
the mean). The band is the coherent grad scale's (sp_harness.compare.grad_scale.scale_band):
between 0 and MISMATCH x the members' mean beta, plus SCALAR_ROUNDINGS unit roundoffs, plus
t(nu) standard errors.

What it does not model: an error shared by many tokens (an attention's mixing carries one
value's rounding into every query's output), which clustering by token does not see. It is a
fraction of the piece's error norm, so it scales with how many roundings deep that error is: in
bfloat16 (about 2 unit roundoffs deep) correct runs put it at a quarter of a unit roundoff at
most, inside the SCALAR_ROUNDINGS edge, and the members carry it too; in float32 (12 deep in a
4-layer model) it reached 1.8 unit roundoffs at 9 standard errors, so float32 is not judged
this way (sp_harness.compare.tolerance._output_scale; docs/false-alarms.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sp_harness.compare.grad_scale import GradScale, GradScaleBound, scale_band

MIN_TOKENS = 8.0
"""Fewer effective tokens than this and the scale is not judged: its standard error would rest
on a handful of samples, whose t tail is too wide to say anything."""


def token_rows(out: torch.Tensor, tokens: int) -> torch.Tensor | None:
    """`out` as (tokens, features): its leading dims that multiply to `tokens` are the tokens
    (a (B, S, V) or (S, B, V) output; (B, S, heads, dim) too), or None where none do."""
    size = 1
    for n in out.shape[:-1]:
        size *= n
        if size == tokens:
            return out.reshape(tokens, -1)
    return None


def token_scale(err: torch.Tensor, out: torch.Tensor, tokens: int) -> tuple[GradScale, float] | None:
    """`err` (a piece's error against the float64 output `out`)'s coherent scale along `out`,
    with its token-clustered standard error and degrees of freedom, or None where the piece's
    tokens cannot be told apart or are too few."""
    weights = token_weights(out, tokens)
    return None if weights is None else _clustered(err, weights)


@dataclass(frozen=True)
class TokenWeights:
    """What every error's scale along one output needs of it."""

    rows: torch.Tensor
    """(T, features) the output in float64."""
    norms: torch.Tensor
    """(T,) |y_t|^2."""
    dof: float
    """The effective number of tokens less one: (sum w^2)^2 / sum w^4 - 1."""


def token_weights(out: torch.Tensor, tokens: int) -> TokenWeights | None:
    """`out`'s TokenWeights, or None where its tokens cannot be told apart or are fewer than
    MIN_TOKENS effective ones."""
    rows = token_rows(out.to(torch.float64), tokens)
    if rows is None:
        return None
    norms = rows.square().sum(1)
    total = float(norms.sum())
    if total <= 0:
        return None
    w = norms / total
    n_eff = float(w.square().sum()) ** 2 / float(w.square().square().sum())
    return None if n_eff < MIN_TOKENS else TokenWeights(rows=rows, norms=norms, dof=n_eff - 1)


def _clustered(err: torch.Tensor, weights: TokenWeights) -> tuple[GradScale, float]:
    errs = err.to(torch.float64).reshape(weights.rows.shape)
    norms = weights.norms
    held = norms > 0
    beta_t = (errs * weights.rows).sum(1)[held] / norms[held]
    w = norms[held] / norms.sum()
    beta = float((w * beta_t).sum())
    count = int(held.sum())
    se = math.sqrt(count / (count - 1) * float((w.square() * (beta_t - beta).square()).sum()))
    return GradScale(beta=beta, se=se), weights.dof


def output_scale_bound(*, err: torch.Tensor, member_errs: Sequence[torch.Tensor], out: torch.Tensor, tokens: int,
                       dtype: torch.dtype) -> GradScaleBound | None:
    """The run's coherent output scale (its error `err`) against the members' (`member_errs`),
    or None where it cannot be judged this way (no members, tokens not found or too few)."""
    if not member_errs:
        return None
    weights = token_weights(out, tokens)
    if weights is None:
        return None
    run, dof = _clustered(err, weights)
    members = [_clustered(e, weights)[0] for e in member_errs]
    return scale_band(run=run, members=members, dof=dof, dtype=dtype)
