"""Stage: compare. The tolerance model, pure and process-group free.

Every sharded quantity is judged against a float64 reference computed from the same weights
(the sharded run's own, re-anchored every step: sp_harness.step.anchor) and the same data. What it may
deviate by is not tuned per case or per machine: it is measured on the very computation by two
more references, both run by sp_harness.checks.side_by_side_rank:

- `ref_lp`, the same model in the run's precision (float32 for a float64 run, its error scaled
  by eps64/eps32), its matmuls carrying a random summation-order error (the worst-order walk; float32: a sequential kernel's)
  (sp_harness.step.adversary.order_error): what a correct single-device run on the least accurate legal
  kernel errs by.
- `ref_alt`, float64 with every weight, float input, and every op's inputs and result perturbed by
  a random relative eps(dtype), plus the same order error: the backward-error view, which covers
  what ref_lp can miss (a tensor that is a cancellation of much larger terms, rounded exactly by
  ref_lp by luck; a fused kernel's internal rounding).

Two bounds, both must hold:

    max-abs    max|err| <= FACTOR * max(e_lp, e_alt, e_members) + FLOOR_ULPS * eps(dtype) * max|ref64|
               (FACTOR: max_abs_factor, wider for pieces of one or two elements; e_members:
               the ensemble's other members, where the run has them)
    norm-wise  ||err||  <= NORM_FACTOR * ||e_lp|| + NORM_FLOOR_ULPS * eps(dtype) * ||ref64||
               (pieces of NORM_MIN_NUMEL elements or more; in a run with ensemble members the
               ensemble's bound instead, smaller pieces too: member_dof)

The optimizer step has its own elementwise bound (sp_harness.compare.tensor_check.check_bounded,
sp_harness.step.optim_ref), the loss an allowance propagated from its output
(side_by_side_rank._loss_allowance). What depends on the run dtype is its `Precision` record
(sp_harness.step.precision); the degrees of freedom live in sp_harness.compare.dof.

The rules and their reasons: docs/tolerance.md; the measurements and false alarms behind each,
and the models before it: docs/history/tolerance-model.md; the false-alarm rate they give:
docs/false-alarms.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sp_harness.compare.dof import GRAD_DOF_SHARE, member_dof, row_participation
from sp_harness.compare.grad_scale import GradScaleBound, PieceNoise, grad_scale_bound
from sp_harness.compare.output_scale import output_scale_bound
from sp_harness.compare.tensor_check import TensorCheck
from sp_harness.step.precision import Precision

FACTOR = 16.0
"""How many times the references' worst element error the sharded run's worst element may reach:
the worst element of one rounding process against the worst of another has a heavy tail, hence
a wide factor here and a narrow one for norms (NORM_FACTOR). Logic bugs sit 4+ orders above."""
SMALL_PIECE_QUANTILE = ((1, 252.3), (2, 21.73), (3, 10.02))
"""(n, q): the 1 - 1e-5 quantile of max_i |X_i| / max(max_i |Y1_i|, max_i |Y2_i|) over n
elements of independent normal errors of one scale (the exact integral
P = int n F(x)^(n-1) f(x) F(x/q)^(2n) dx, F the half-normal CDF: `tests/demo/max_ratio.py`): how
far the worst element of one rounding process exceeds the worst of two others' once in 1e5
pieces of n elements. For one element it is a single sample against the larger of two, whose
tail falls as 0.64/q^2 only, so FACTOR alone would pass about 1 in 400; from 3 elements
MISMATCH x q is under FACTOR, which stays (docs/tolerance.md, "Pieces of one or two elements")."""
FLOOR_ULPS = 8.0
"""Absolute floor, in units of eps(dtype) * max|ref64|: covers tensors the reference happens
to round exactly (its measured error is 0) while a different reduction order does not."""

NORM_FACTOR = 4.0
"""How many times the references' error NORM the sharded run's error norm may reach.

The max-abs bound above must hold for the single worst element of two independent rounding
processes, hence its 16x. A norm over many elements concentrates: the sharded run's rounding
error and the reference's are draws of the same kind of process (other orders, other splits),
so their norms agree to a small factor, while a systematic error (a shard scaled by 1 + d, a
grad missing a small term) adds coherently over the whole shard. 4x over a ratio whose expected
value is about 1 (docs/tolerance.md, "The norm-wise bound")."""
NORM_MIN_NUMEL = 64
"""Below this many elements the two-reference norm (NORM_FACTOR, a fixed factor) does not
concentrate; only the max-abs bound applies there, except in a run with ensemble members, whose
norm-wise factor counts the piece's degrees of freedom however few (ensemble_factor), capped by
those its members' errors show (member_dof)."""
NORM_MIN_DOF = 8
"""Nor below this many tokens behind the tensor: a weight grad from T tokens is a sum of T outer
products, and its error has about T independent sources however many elements it spans, too
few below this for a norm to concentrate (docs/tolerance.md, "The norm-wise bound")."""
NORM_FLOOR_ULPS = 2.0
"""Norm-wise floor: an rms error of 2 ulps of the tensor's rms (a reference that happens to be
exact still leaves the sharded run its own final roundings)."""

CHI_RATIO_QUANTILE = ((1, 252.3), (2, 19.4), (3, 9.67), (4, 6.19), (6, 4.20), (8, 3.33), (16, 2.30), (32, 1.81),
                      (64, 1.53), (256, 1.24))
"""(m, q): the 1 - 1e-5 quantile of X / max(Y1, Y2) for independent chi-distributed X, Yk with
m degrees of freedom (1e6 draws from 8 up, 4e6 below, `tests/demo/chi_ratio.py --samples 2`; at
one degree of freedom the half-normal's exact integral, SMALL_PIECE_QUANTILE's first row): how
far one rounding process's error norm exceeds the larger of two others' once in 1e5 tensors,
when each norm is m independent contributions (docs/tolerance.md, "Degrees of freedom")."""
MISMATCH = 1.5
"""What a correct sharded run may round beyond the ensemble: the 'rounded' member rounds every
op's result and every rank-split reduction's parts, but not inside fused ops it cannot split
(a LayerNorm's weight grad summed over ranks in the run dtype: one more rounding, sqrt(2) in
norm). The campaigns measure it (docs/false-alarms.md; docs/tolerance.md, "The ensemble bound")."""


def ensemble_factor(dof: float) -> float:
    """How many times the ensemble's largest error norm a correct sharded run's may reach, for a
    piece with `dof` independent contributions: MISMATCH x the chi ratio's quantile, linear in
    log(m) between the table's rows and flat beyond them."""
    table = CHI_RATIO_QUANTILE
    if dof <= table[0][0]:
        return MISMATCH * table[0][1]
    for (m0, q0), (m1, q1) in zip(table, table[1:], strict=False):
        if dof <= m1:
            t = (math.log(dof) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return MISMATCH * (q0 + t * (q1 - q0))
    return MISMATCH * table[-1][1]


def max_abs_factor(numel: int) -> float:
    """How many times the references' worst element error a piece of `numel` elements' worst may
    reach: FACTOR, or MISMATCH x the small-piece quantile where that is larger (1 and 2
    elements)."""
    for n, q in SMALL_PIECE_QUANTILE:
        if numel <= n:
            return max(FACTOR, MISMATCH * q)
    return FACTOR


ENSEMBLE_KINDS = frozenset({"forward", "lse", "grad", "input_grad"})
"""The checks the ensemble bound judges: every one the references compute (the loss has its
propagated allowance, the update its own bound). Grads rely on the 'rounded' member's backward
forming softmax's row sum D from the rounded output, as a flash kernel does
(sp_harness.step.rounding.RoundedResults), and on the perturbed reference over ALT_OVERESTIMATE
as a third member (docs/tolerance.md, "The ensemble bound")."""
BACKWARD_KINDS = frozenset({"grad", "input_grad"})
ALT_OVERESTIMATE = 3.0
"""For grads and input grads the ensemble's largest error is at least the perturbed reference's
over this: alt overstates a real kernel's error about 3-fold. A grad is a sum over tokens that a
sharded run splits by its own shards and reduces across ranks in the run dtype; where that sum
cancels (a norm's bias grad, an MLP of one unit), the rounding of its per-rank parts follows the
parts, not the result, which the members (rounding results, at random splits) see less of than
alt (rounding every op's inputs). docs/tolerance.md, "The ensemble bound"."""
NO_CANCELLATION = 1.5
"""A Linear weight grad piece whose per-token terms' root sum of squares is at most this many
times the piece's norm (PieceNoise.cancellation) is not a cancelling sum, and the perturbed
reference's term (ALT_OVERESTIMATE) is left out of its noise: however a sharded run splits its
tokens, its per-rank parts are then about as large as the terms' root sum of squares, the size
the 'rounded' member's random splits round at too (a key projection's terms, which sum to zero
over the keys, measure above it). An attention's projections (step.reference.LinearTerms) get no
`cancellation` and keep alt's term: their inputs or output grads come through the attention's
token mixing, which a sharded run orders differently from the members. docs/tolerance.md,
"Plain sums leave alt out; the floor in quadrature"."""
PLAIN_NOISE_UNITS = 8.0
"""...and whose members err by at most this many unit roundoffs of its norm: a grad whose
per-token terms are themselves cancellations (a q-proj's, through softmax's backward p (g - D))
errs far more than its terms' roundings, and keeps alt's term (docs/tolerance.md, "Plain sums
leave alt out; the floor in quadrature")."""
PLAIN_MIN_WIDTH = 8
"""...and that has at least this many rows and columns. In a narrow piece one unit's column (or
row) can carry the error, an error whose count of independent parts no per-token model of the
piece bounds from below (docs/tolerance.md, "Plain sums leave alt out; the floor in
quadrature")."""
CANCELLATION = 0.5
"""A piece whose ensemble errs by this fraction of its own norm or more is a cancellation of much
larger terms (a grad that is zero in exact arithmetic, softmax's shift invariance): the
ensemble's error there says how much the terms cancel, not how a legal order rounds them, so it
keeps the two-reference bound (NORM_FACTOR), whose perturbed reference rounds the terms."""
VACUOUS_KINDS = ENSEMBLE_KINDS
"""The checks whose pieces are withheld where their bounds would pass a zero tensor (vacuous):
those the ensemble's members judge, in runs below float32."""


def vacuous(kind: str, samples: Sequence[torch.Tensor], allowed: float, largest: float, norm: NormBound) -> float:
    """Where a piece's bounds, derived from the correct references alone, would pass a zero
    tensor in its place: its max-abs bound `allowed` is at least its `largest` element, and its
    norm-wise bound (`norm.bound`, None where the piece has none) at least its norm. Returned:
    the smaller of those bounds over the piece's own size (>= 1); 0 where a bound binds, where
    the piece is exactly zero (known exactly), or where it has no ensemble (float32 and float64
    judge every piece: their campaigns found no false alarm there, and their pieces that are
    zero in exact arithmetic, an attention's k-proj bias grad, are judged).

    Such a check cannot tell the piece from a grad never computed, the commonest SP bug, so its
    PASS says nothing, and its FAIL is no verdict either where correct runs land in a
    heavy-tailed spread (a config whose backward amplifies one rounding of its weights into a
    grad's whole norm). The piece is not judged and the result names it (TensorCheck.vacuous).
    Decided by the references alone: a run cannot withhold its own piece. docs/tolerance.md,
    "Vacuous checks"."""
    if kind not in VACUOUS_KINDS or not samples:
        return 0.0
    if largest == 0 or allowed < largest or (norm.bound is not None and norm.bound < norm.ref):
        return 0.0
    sizes = [allowed / largest]
    if norm.bound is not None:
        sizes.append(norm.bound / norm.ref)
    return min(sizes)


ENSEMBLE_FLOOR_UNITS = 1.0
"""Ensemble floor, in units of the unit roundoff eps/2 times ||ref64||: a final rounding to the
run dtype changes every element by at most u |x|, so by at most u ||x|| in norm, whatever the
references did (a tensor they all rounded exactly). It adds to the ensemble's term in quadrature:
the run's final rounding and the error it rounds are independent, and over a piece of at least
NORM_MIN_DOF degrees of freedom their cross term is small next to both; the members' errors
already hold their own final rounding (about 0.58 u ||x||), so the floor binds only where they
rounded (nearly) exactly (docs/tolerance.md, "The ensemble bound")."""

def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@dataclass(frozen=True)
class RefPieces:
    """One piece (a rank's, of one tensor) of every reference a check has, in float64 or their
    own precision: what a tensor is judged against."""

    r64: torch.Tensor
    """The float64 reference: the value the piece should have."""
    lp: torch.Tensor
    """The run-precision reference (Precision.reference): its error is a correct run's."""
    alt: torch.Tensor | None = None
    """The perturbed float64 reference (every op's inputs and result perturbed by eps), if any."""
    members: tuple[torch.Tensor, ...] = ()
    """The ensemble's other members (Precision.members), for a run that has them."""


def check_tensor(*, kind: str, name: str, step: int, rank: int, got: torch.Tensor | None, refs: RefPieces,
                 precision: Precision, offset: tuple[int, ...] = (), extra_allowed: float = 0.0, dof: int = 0,
                 grad_dof: float | None = None, grad_noise: PieceNoise | None = None,
                 summed_over: int = 1) -> TensorCheck:
    """Judge `got` (a rank's piece) against the float64 reference piece `refs.r64`, in a run whose
    dtype's rules are `precision`.

    `refs` holds the same piece of every reference; `offset` is where the piece starts in the
    full tensor, so the reported index is a reference index. `extra_allowed` is an absolute allowance the caller
    derives from the computation (the loss's, propagated from its output's error). `dof`: the
    number of tokens behind the tensor, which gates the norm-wise bound (NORM_MIN_DOF).
    With the ensemble's members (`refs.members`, Precision.members) the norm-wise bound of the
    pieces they judge (ENSEMBLE_KINDS) is the ensemble's.
    `grad_dof`: a Linear's weight or bias grad piece's degrees of freedom, derived from its
    per-token terms (weight_grad_dof, bias_grad_dof); None: a share of `dof` (GRAD_DOF_SHARE).
    `grad_noise`: the same derived for a Linear or norm weight grad piece together with its
    noise's share along the grad: with the ensemble's members, the piece's coherent scale is
    measured against its band and recorded (`scale_ratio`; sp_harness.compare.grad_scale).
    With the ensemble's members, a forward piece's coherent scale along its exact output is
    judged too (sp_harness.compare.output_scale). `summed_over`: the ranks a grad may be summed
    over in the run dtype (the world size), which sets a plain sum's floor (plain_floor_units).
    """
    cancellation = math.inf
    if grad_noise is not None:
        grad_dof, cancellation = grad_noise.dof, grad_noise.cancellation
    dtype, ref64 = precision.dtype, refs.r64
    if got is None:
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=float("inf"),
                           max_rel=float("inf"), allowed=0.0, ratio=float("inf"), worst_index=(),
                           got=float("nan"), want=float(ref64.abs().max()) if ref64.numel() else 0.0,
                           ok=bool(ref64.numel() == 0 or not ref64.any()), note="no gradient")
    if tuple(got.shape) != tuple(ref64.shape):
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=float("inf"),
                           max_rel=float("inf"), allowed=0.0, ratio=float("inf"), worst_index=(),
                           got=float("nan"), want=float("nan"), ok=False,
                           note=f"shape {tuple(got.shape)} != reference piece {tuple(ref64.shape)}")
    if ref64.numel() == 0:
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=0.0, max_rel=0.0,
                           allowed=0.0, ratio=0.0, worst_index=(), got=0.0, want=0.0, ok=True)
    # a float64 reference that computed this tensor in a coarser dtype (a float32 loss island)
    # knows it no better than that dtype: its floor is at that dtype's ulps
    floor_eps = max(eps(dtype), torch.finfo(ref64.dtype).eps if ref64.is_floating_point() else 0.0)
    got64 = got.detach().to(torch.float64)
    ref64 = ref64.detach().to(torch.float64)
    refs = dataclasses.replace(refs, r64=ref64)
    err = (got64 - ref64).abs()
    nonfinite = ~torch.isfinite(got64)
    if nonfinite.any():
        err = torch.where(nonfinite, torch.full_like(err, float("inf")), err)
    scale = float(ref64.abs().max())
    # the precision the reference ran in, not its result's dtype: a float32 output against a
    # float64 target promotes the loss to float64, and scaling that by eps32/eps64 would allow 1e7x
    ref_err = float((refs.lp.detach().to(torch.float64) - ref64).abs().max()) * (eps(dtype) / eps(precision.reference))
    if refs.alt is not None:
        ref_err = max(ref_err, float((refs.alt.detach().to(torch.float64) - ref64).abs().max()))
    # the ensemble's members are legal implementations too: where alt's one draw happens to err
    # little on a cancellation, 'rounded' (a flash-style row sum from the rounded output) may
    # not (docs/tolerance.md, "The max-abs bound")
    for member in refs.members:
        ref_err = max(ref_err, float((member.detach().to(torch.float64) - ref64).abs().max()))
    # a scalar loss keeps FACTOR: its allowance is propagated from its output's many elements
    # (extra_allowed), which is what a single sample lacks
    factor = FACTOR if kind == "loss" else max_abs_factor(ref64.numel())
    allowed = factor * ref_err + FLOOR_ULPS * floor_eps * max(scale, 1e-30) + extra_allowed
    norm = (_norm_bound(kind, got64 - ref64, refs, precision, dof, grad_dof, cancellation, summed_over)
            if dof >= NORM_MIN_DOF else NormBound())
    withheld = 0.0 if nonfinite.any() else vacuous(kind, refs.members, allowed, scale, norm)
    flat = int(err.reshape(-1).argmax())
    max_abs = float(err.reshape(-1)[flat])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape)) if err.dim() else ()
    if offset:
        index = tuple(i + o for i, o in zip(index, offset, strict=True))
    coherent = (_scale_bound(got64 - ref64, refs, grad_noise, dtype)
                if kind == "grad" and grad_noise is not None and norm.dof else None)
    if kind == "forward" and dof >= NORM_MIN_DOF and refs.members:
        coherent = _output_scale(got64 - ref64, refs, dof, dtype)
    scale_ratio = 0.0 if coherent is None else coherent.ratio
    ratio = max(max_abs / allowed if allowed else float("inf"), norm.ratio)
    # a forward output's scale is judged; a grad's is recorded only: an attention's key
    # projection carries coherent errors that differ between correct implementations beyond the
    # model (sp_harness.compare.grad_scale)
    if kind == "forward":
        ratio = max(ratio, scale_ratio)
    withheld_ratio = 0.0
    if withheld:
        withheld_ratio, ratio = ratio, 0.0
    return TensorCheck(
        kind=kind, name=name, step=step, rank=rank, max_abs=max_abs,
        max_rel=max_abs / scale if scale else max_abs, allowed=allowed, ratio=ratio, worst_index=index,
        got=float(got64.reshape(-1)[flat]), want=float(ref64.reshape(-1)[flat]),
        ok=ratio <= 1.0, norm_ratio=norm.ratio, err_norm=norm.err, noise_norm=norm.noise, ref_norm=norm.ref,
        dof=norm.dof, scale_ratio=scale_ratio, scale=0.0 if coherent is None else coherent.run.beta,
        vacuous=withheld, withheld_ratio=withheld_ratio,
    )


def _scale_bound(diff: torch.Tensor, refs: RefPieces, noise: PieceNoise, dtype: torch.dtype) -> GradScaleBound | None:
    """The coherent-scale bound of a grad piece the ensemble judged (its members: the
    run-precision reference and the members)."""
    if not torch.isfinite(diff).all():
        return None
    members = [m.detach().to(torch.float64) - refs.r64 for m in (refs.lp, *refs.members)]
    return grad_scale_bound(err=diff, member_errs=members, grad=refs.r64, noise=noise, dtype=dtype)


def _output_scale(diff: torch.Tensor, refs: RefPieces, tokens: int, dtype: torch.dtype) -> GradScaleBound | None:
    """The coherent-scale bound of a forward output piece of a run below float32
    (sp_harness.compare.output_scale), its members the ensemble's (the run-precision reference
    and the members); none where the run is not finite or a member errs by CANCELLATION of the
    piece (the piece is a cancellation, not a scale). float32 is not judged this way: its correct
    runs carry a coherent error shared across tokens that the clustered standard error does not
    see (docs/tolerance.md, "The coherent output scale")."""
    if not torch.isfinite(diff).all():
        return None
    errs = [m.detach().to(torch.float64) - refs.r64 for m in (refs.lp, *refs.members)]
    if max(float(e.norm()) for e in errs) >= CANCELLATION * float(refs.r64.norm()):
        return None
    return output_scale_bound(err=diff, member_errs=errs, out=refs.r64, tokens=tokens, dtype=dtype)


@dataclass(frozen=True)
class NormBound:
    """The norm-wise comparison of one piece (all zero where none applies)."""

    ratio: float = 0.0
    err: float = 0.0
    noise: float = 0.0
    ref: float = 0.0
    dof: float = 0.0
    """The degrees of freedom the ensemble's factor counted (0 where another bound judged)."""
    bound: float | None = None
    """The norm-wise bound on ||err|| (None where the piece has none)."""


def _norm_bound(kind: str, diff: torch.Tensor, refs: RefPieces, precision: Precision, dof: int,
                grad_dof: float | None = None, cancellation: float = math.inf, summed_over: int = 1) -> NormBound:
    """||got - ref64|| (`diff`) over the piece against its norm-wise bound: the ensemble's
    (ensemble_factor(dof)) where the run has members and the check is one they judge
    (ENSEMBLE_KINDS), else NORM_FACTOR x the two references' error norm (see NORM_FACTOR). A
    check in Precision.alt_member_kinds takes the smaller of the two-reference bound and a
    two-member ensemble's (the run-precision and perturbed references): each holds on its own,
    so their false-alarm rates add."""
    # a piece too small for the two-reference norm to concentrate still has the ensemble's, whose
    # factor counts its degrees of freedom however few (the members' own count caps them there)
    small = diff.numel() < NORM_MIN_NUMEL
    samples = refs.members
    if small and not (samples and kind in ENSEMBLE_KINDS):
        return NormBound()
    dtype, ref64 = precision.dtype, refs.r64
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    ref_norm = float(ref64.norm())
    got = float(diff.norm())
    both = refs.alt is not None and not samples and kind in precision.alt_member_kinds
    if kind not in ENSEMBLE_KINDS:
        samples = ()
    elif refs.alt is not None and both:
        samples = (refs.alt,)
    ensemble = _ensemble_bound(kind, refs, samples, dtype, dof, diff.numel(), ref_norm, grad_dof, cancellation,
                               summed_over)
    if small and ensemble is None:
        return NormBound()
    m = 0.0
    if ensemble is not None and not both:
        noise, bound, m = ensemble
    else:
        noise = float((refs.lp.detach().to(torch.float64) - ref64).norm()) * (eps(dtype) / eps(precision.reference))
        if refs.alt is not None:
            noise = max(noise, float((refs.alt.detach().to(torch.float64) - ref64).norm()))
        bound = NORM_FACTOR * noise + NORM_FLOOR_ULPS * eps(dtype) * ref_norm
        if ensemble is not None and ensemble[1] < bound:
            noise, bound, m = ensemble
    if got == 0:
        return NormBound(err=0.0, noise=noise, ref=ref_norm, dof=m, bound=bound)
    return NormBound(ratio=got / bound if bound else float("inf"), err=got, noise=noise, ref=ref_norm, dof=m,
                     bound=bound)


def _ensemble_bound(kind: str, refs: RefPieces, samples: Sequence[torch.Tensor], dtype: torch.dtype, dof: int,
                    most: int, ref_norm: float, grad_dof: float | None = None, cancellation: float = math.inf,
                    summed_over: int = 1) -> tuple[float, float, float] | None:
    """(noise, bound, degrees of freedom) of the ensemble's norm-wise bound over a piece (at most
    `most` degrees of freedom), its members the run-precision reference and `samples`, or None
    where there are no `samples` or the members err by CANCELLATION of the piece or more."""
    if not samples:
        return None
    ref64, ref_alt = refs.r64, refs.alt
    errs = [s.detach().to(torch.float64) - ref64 for s in (refs.lp, *samples)]
    noise = max(float(e.norm()) for e in errs)
    if noise >= CANCELLATION * ref_norm:
        return None
    plain_sum = (kind == "grad" and cancellation <= NO_CANCELLATION and min(ref64.shape) >= PLAIN_MIN_WIDTH
                 and noise <= PLAIN_NOISE_UNITS * eps(dtype) / 2 * ref_norm)
    if kind in BACKWARD_KINDS and ref_alt is not None and not plain_sum:
        noise = max(noise, float((ref_alt.detach().to(torch.float64) - ref64).norm()) / ALT_OVERESTIMATE)
    if kind == "grad":
        m = dof * GRAD_DOF_SHARE if grad_dof is None else min(dof, grad_dof)
    else:
        m = min(dof, row_participation(errs))
    m = min(m, most)
    if most < NORM_MIN_NUMEL:
        alt = [] if ref_alt is None else [ref_alt.detach().to(torch.float64) - ref64]
        m = min(m, member_dof([*errs, *alt]))
    floor = plain_floor_units(summed_over) if plain_sum else ENSEMBLE_FLOOR_UNITS
    return noise, math.hypot(ensemble_factor(m) * noise, floor * eps(dtype) / 2 * ref_norm), m


def plain_floor_units(summed_over: int) -> float:
    """A plain sum's floor (its noise without alt's term), in units of u ||ref||: sqrt(R) x
    ENSEMBLE_FLOOR_UNITS. The run sums its grad over up to R = `summed_over` ranks in the run
    dtype, rounding R partials and R - 1 running sums: for a coherent sum at most about
    sqrt(3) x 0.58 sqrt(1/R + sum_k=2..R (k/R)^2) unit roundoffs of the piece's norm (1.22 at
    R = 2, 1.44 at 4, 1.82 at 8), which sqrt(R) exceeds; the members round such a reduction
    only at their random splits (docs/tolerance.md, "Plain sums leave alt out; the floor in
    quadrature")."""
    return ENSEMBLE_FLOOR_UNITS * math.sqrt(max(summed_over, 1))

