"""Stage: compare. Degrees of freedom of a piece's error norm: how many independent
contributions a reference's error over a piece is made of, which sets how far one rounding
process's error norm may exceed another's (sp_harness.compare.tolerance.ensemble_factor). Derived
from a Linear's per-token terms (weight_grad_dof, bias_grad_dof), from the members' errors
(member_dof, row_participation), or a share of the tokens (GRAD_DOF_SHARE). docs/tolerance.md,
"Degrees of freedom"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

GRAD_DOF_SHARE = 0.25
"""Effective independent contributions per token of a param grad's error, where none are derived
(weight_grad_dof and bias_grad_dof do for an nn.Linear's): norm weights, embeddings, a
framework's own linear modules. A weight grad is a sum of one outer product per token, and its
error norm has as many degrees of freedom as tokens only if they weigh alike; a gated unit sees
some tokens only (docs/tolerance.md, "Degrees of freedom")."""
def member_dof(errs: Sequence[torch.Tensor]) -> float:
    """The degrees of freedom the references' errors of one piece show, from their most aligned
    pair: the least |e_i|^2 |e_j|^2 / (e_i . e_j)^2 over pairs. For two independent errors of one
    process with covariance C (any scale each: it cancels) the quotient's numerator and
    denominator estimate (tr C)^2 and tr C^2, whose quotient is the chi model's count
    (Satterthwaite's); errors that share a direction, as a piece's do where one token's rounding
    is amplified into it, count one.

    Used for pieces under NORM_MIN_NUMEL elements only, where it caps the count derived from the
    piece's per-token terms, which assumes every token errs alike: one token whose error is
    amplified into the piece makes it one vector. The least of the pairs is low by chance and
    because the members share roundings: both widen the bound, never narrow it. Larger pieces
    keep the derived count alone. docs/tolerance.md, "Small pieces"."""
    least = math.inf
    for i, a in enumerate(errs):
        for b in errs[i + 1:]:
            aligned = float((a * b).sum()) ** 2
            if aligned > 0:
                least = min(least, float(a.square().sum()) * float(b.square().sum()) / aligned)
    return least


DOF_SAMPLE_TOKENS = 128
"""weight_grad_dof sums its token pairs over an evenly strided sample of at most this many tokens
(and the rest exactly): the pairs cost tokens^2 x width, 30 GFLOP a step at hidden 256, 1024
tokens, where 128 of them cost a 64th of that."""


@dataclass(frozen=True)
class TokenSide:
    """Per-token statistics of one side of a Linear's per-token terms (its inputs at a piece's
    columns, or its output grads at a piece's rows): all weight_grad_dof needs of it, shared by
    every piece with the same columns (rows)."""

    sq: torch.Tensor
    """(T,) sum over the elements of v_t^2."""
    fourth: torch.Tensor
    """(T,) sum of v_t^4."""
    gram_sq: torch.Tensor
    """(S, S) (v_t . v_s)^2 over the token sample."""
    sq_gram: torch.Tensor
    """(S, S) sum_j v_tj^2 v_sj^2 over the token sample."""
    sample: torch.Tensor
    """(S, width) the sampled tokens' v (sp_harness.compare.grad_scale.weight_share sums over them)."""


def token_side(v: torch.Tensor) -> TokenSide:
    """`v` (T, width)'s TokenSide, its pairs over an evenly strided sample of at most
    DOF_SAMPLE_TOKENS tokens."""
    v = v.to(torch.float64)
    v2 = v.square()
    pick = torch.linspace(0, v.shape[0] - 1, min(v.shape[0], DOF_SAMPLE_TOKENS)).round().long().unique()
    vs, v2s = v[pick], v2[pick]
    return TokenSide(sq=v2.sum(1), fourth=v2.square().sum(1), gram_sq=(vs @ vs.T).square(), sq_gram=v2s @ v2s.T,
                     sample=vs)


def weight_grad_dof(x: torch.Tensor | TokenSide, g: torch.Tensor | TokenSide) -> float:
    """Degrees of freedom of the error norm of a weight grad piece sum_t g_t x_t^T, from its
    per-token inputs `x` (T, in) and output grads `g` (T, out), restricted to the piece's columns
    and rows (or their TokenSides). Model: each token's g and x carry independent relative errors
    per element, so the error is vec(E) ~ N(0, C), C = sum_t diag(g_t^2) (x) x_t x_t^T + g_t g_t^T
    (x) diag(x_t^2), and ||E||^2 is close to a scaled chi-square of (tr C)^2 / tr C^2 degrees of
    freedom (Satterthwaite), counted for each of the two terms alone and the fewer returned (the
    terms' weights are not known: below). Fewer where a few tokens carry the sum (a gated unit) and where the
    tokens' inputs share a direction (a LayerNorm output feeding one unit: E is then nearly
    sum_t dg_t x_t, one vector): a one-unit fc1 weight grad over 690 tokens has about 7. The
    trace and each token with itself are summed over every token; pairs of different tokens
    over at most DOF_SAMPLE_TOKENS of them, scaled up."""
    xs = x if isinstance(x, TokenSide) else token_side(x)
    gs = g if isinstance(g, TokenSide) else token_side(g)
    trace = float((gs.sq * xs.sq).sum())  # tr C_g = tr C_x
    if trace <= 0:
        return float("inf")
    n, s = xs.sq.shape[0], xs.gram_sq.shape[0]
    scale = n * (n - 1) / (s * (s - 1)) if s > 1 else 0.0

    def square_trace(token_with_itself: torch.Tensor, pairs: torch.Tensor) -> float:
        return float(token_with_itself.sum()) + float(pairs.sum() - pairs.diagonal().sum()) * scale

    # A = sum_i g_ti^2 g_si^2, A' = (g_t . g_s)^2, B = (x_t . x_s)^2, B' = sum_j x_tj^2 x_sj^2;
    # a token with itself: A_tt = sum g^4, A'_tt = |g|^4, B_tt = |x|^4, B'_tt = sum x^4
    errs_in_g = square_trace(gs.fourth * xs.sq.square(), gs.sq_gram * xs.gram_sq)  # tr C_g^2 = sum A B
    errs_in_x = square_trace(gs.sq.square() * xs.fourth, gs.gram_sq * xs.sq_gram)  # tr C_x^2 = sum A' B'
    # C weighs the two alike (equal relative errors in g and x), but where one side's values are
    # themselves cancellations (a GELU unit's input summed from much larger terms) its relative
    # error is far larger and its term alone sets E: whatever the weights, the count is at least
    # the fewer of the two terms' (Cauchy-Schwarz), which is what is returned (docs/tolerance.md,
    # "Degrees of freedom")
    return min(trace * trace / errs_in_g, trace * trace / errs_in_x)


def bias_grad_dof(g: torch.Tensor, side: TokenSide | None = None) -> float:
    """Degrees of freedom of the error norm of a bias grad piece sum_t g_t from its per-token
    output grads `g` (T, out) at the piece's rows (and their TokenSide, where the weight piece of
    the same rows made it): the fewer of two error models'. Elementwise errors make its elements
    independent normals of variance S_i = sum_t g_ti^2, whose norm has (sum S)^2 / sum S^2 (at
    most the piece's elements, however many tokens); errors that move a token's whole g_t at once
    (the residual stream's grad errs as whole vectors, through the weights that feed it) make it a
    sum of one vector per token (token_dof)."""
    g = g.to(torch.float64)
    return min(element_participation(g.square().sum(0)), token_dof(side if side is not None else token_side(g)))


def token_dof(v: TokenSide) -> float:
    """Satterthwaite's degrees of freedom of sum_t e_t v_t, one scalar error e_t per token's
    vector v_t: (sum_t |v_t|^2)^2 / sum_t,s (v_t . v_s)^2, each token with itself over every
    token, pairs of different tokens over the TokenSide's sample, scaled up (as weight_grad_dof).
    As many as tokens where they are orthogonal and alike, one where they share a direction."""
    total = float(v.sq.sum())
    if total <= 0:
        return 1.0
    n, s = v.sq.shape[0], v.gram_sq.shape[0]
    off = float(v.gram_sq.sum() - v.gram_sq.diagonal().sum()) * (n * (n - 1) / (s * (s - 1)) if s > 1 else 0.0)
    # at least 1 (Cauchy-Schwarz: sum_t,s (v_t . v_s)^2 <= (sum_t |v_t|^2)^2), which the sampled
    # pairs can overshoot
    return max(1.0, total * total / (float(v.sq.square().sum()) + off))


def element_participation(variances: torch.Tensor) -> float:
    """(sum S)^2 / sum S^2 over independent normals' variances S: their norm's degrees of freedom."""
    total = float(variances.sum())
    return total * total / float(variances.square().sum()) if total > 0 else float("inf")


def row_participation(errs: Sequence[torch.Tensor]) -> float:
    """The effective number of tokens behind the members' errors of a piece whose leading dims
    are tokens (a forward output, an input grad): (sum w)^2 / sum w^2 over the rows' mean squared
    error norms w. As many as rows when every token errs alike; fewer where a few dominate (a
    LayerNorm over 3 features whose variance cancels on some tokens: a bf16 ring at hidden 3 erred
    2.6x the members at 134 tokens, a chi ratio of far fewer). Its own estimate is noisy, but only
    where it is small, and there it errs towards a wider bound."""
    if not errs or errs[0].dim() < 2:
        return float("inf")
    return element_participation(torch.stack([e.reshape(-1, e.shape[-1]).square().sum(-1) for e in errs]).mean(0))

