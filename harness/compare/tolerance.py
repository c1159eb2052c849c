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

The optimizer step has its own elementwise bound (check_bounded, sp_harness.step.optim_ref), the loss an
allowance propagated from its output (side_by_side_rank._loss_allowance).

The rules and their reasons: docs/tolerance.md; the measurements and false alarms behind each,
and the models before it: docs/history/tolerance-model.md; the false-alarm rate they give:
docs/false-alarms.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sp_harness.compare.grad_scale import GradScaleBound, PieceNoise, grad_scale_bound
from sp_harness.compare.output_scale import output_scale_bound
from sp_harness.compare.update_scale import ScaleBound

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
GRAD_DOF_SHARE = 0.25
"""Effective independent contributions per token of a param grad's error, where none are derived
(weight_grad_dof and bias_grad_dof do for an nn.Linear's): norm weights, embeddings, a
framework's own linear modules. A weight grad is a sum of one outer product per token, and its
error norm has as many degrees of freedom as tokens only if they weigh alike; a gated unit sees
some tokens only (docs/tolerance.md, "Degrees of freedom")."""
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

FLOAT32_ENSEMBLE_KINDS: frozenset[str] = frozenset({"forward", "lse"})
"""The checks a float32 run's ensemble judges: forward outputs and LSEs. Its members are the
run-precision reference and the perturbed one (no third reference), each carrying the
sequential-order matmul error (sp_harness.step.adversary.order_error), and the perturbed one
overestimates a correct sharded forward, so the chi-ratio argument holds. Such a piece takes the
smaller of that bound and the two-reference one (NORM_FACTOR). Never grads: a sharded
attention's backward (a flash-style row sum, ranks' partial dK / dV summed in float32) rounds
what neither member does. float64 keeps the two-reference bound: its run-precision reference is
float32, another process, scaled. docs/tolerance.md, "The ensemble bound"."""

KIND_ORDER = ("init", "forward", "lse", "loss", "input_grad", "grad", "grad_norm", "clip", "param")


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def lp_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the reference's own error is measured in for a run in `dtype`."""
    return torch.float32 if dtype == torch.float64 else dtype


@dataclass(kw_only=True)
class TensorCheck:
    kind: str
    """'init' (sharded params before step 0 against the reference's), 'forward', 'lse' (an
    attention module's per-query log-sum-exp, where the sharded one exposes it), 'loss',
    'input_grad', 'grad', or 'param' (after the optimizer step, against that step applied in
    float64 to the sharded run's own params, grads and state: see sp_harness.step.optim_ref)."""
    name: str
    """Reference tensor name ('output', 'loss', 'input', or a parameter name)."""
    step: int
    rank: int
    max_abs: float
    """max |sharded - ref64| over the rank's piece."""
    max_rel: float
    """max_abs / scale."""
    allowed: float
    ratio: float
    """max_abs / allowed: <= 1 passes."""
    worst_index: tuple[int, ...]
    """Index in the full reference tensor where the error is largest."""
    got: float
    want: float
    ok: bool
    note: str = ""
    norm_ratio: float = 0.0
    """The whole piece's ratio (0 where the piece is too small for one): ||got - ref64|| / its
    norm-wise bound, or for a parameter below float32 after the step its coherent update scale /
    that scale's bound (sp_harness.compare.update_scale)."""
    err_norm: float = 0.0
    """||got - ref64|| over the piece (where a norm-wise bound applies)."""
    noise_norm: float = 0.0
    """The references' error norm the norm-wise bound scales: the ensemble's largest where it
    judges (ENSEMBLE_KINDS, runs below float32), else the larger of the run-precision and
    perturbed references'."""
    ref_norm: float = 0.0
    """||ref64|| over the piece (where a norm-wise bound applies)."""
    dof: float = 0.0
    """The degrees of freedom m the ensemble's factor F(m) counted for the piece (0 where the
    ensemble did not judge it): tokens, their participation, or a Linear grad's derived ones."""
    scale_ratio: float = 0.0
    """A low-precision piece's coherent scale along its exact value / that scale's bound (0 where
    none was computed). A forward output's is judged (part of `ratio`;
    sp_harness.compare.output_scale); a Linear or norm weight grad's is recorded, not judged:
    correct runs' attention key projections exceed its model (sp_harness.compare.grad_scale)."""
    scale: float = 0.0
    """That coherent scale, beta: the piece is (1 + beta) times the exact one plus noise."""
    vacuous: float = 0.0
    """Where the piece's bounds would pass a zero tensor (sp_harness.compare.tolerance.vacuous):
    the smaller bound over the piece's own size, >= 1; the piece is then not judged (ratio 0,
    ok) unless the run is not finite there. 0: judged."""
    withheld_ratio: float = 0.0
    """Where the piece is not judged (`vacuous`): the ratio its bounds would have given it.
    Recorded, never judged: the evidence for judging a class of withheld pieces again (an
    attention's k-proj bias grad, zero in exact arithmetic) comes from it."""

    def describe(self) -> str:
        where = f"[{', '.join(map(str, self.worst_index))}]" if self.worst_index else ""
        extra = f" ({self.note})" if self.note else ""
        if self.kind != "param" and self.norm_ratio > 1 and self.norm_ratio >= self.max_abs / max(self.allowed, 1e-300):
            counted = f", {self.dof:.3g} degrees of freedom" if self.dof else ""
            extra += f" (norm-wise: error norm {self.norm_ratio:.3g}x its bound over the whole piece{counted})"
        if self.kind == "forward" and self.scale_ratio > 1 and self.scale_ratio >= self.max_abs / max(self.allowed, 1e-300):
            sign = "+" if self.scale >= 0 else "-"
            extra += (f" (coherent scale: the piece is (1 {sign} {abs(self.scale):.3g}) x the exact one, "
                      f"{self.scale_ratio:.3g}x the band correct runs span)")
        if self.kind == "param" and self.ratio <= 1 < self.norm_ratio:
            return (f"step {self.step} {self.kind} {self.name} rank {self.rank}: {self.note}, "
                    f"{self.norm_ratio:.3g}x its bound over the whole piece (every element within its own "
                    f"bound, the worst at {self.ratio:.3g}x)")
        # a piece failed norm-wise or by its scale may have every element inside the max-abs bound
        elementwise = self.max_abs / self.allowed if self.allowed else float("inf")
        return (f"step {self.step} {self.kind} {self.name}{where} rank {self.rank}: "
                f"got {self.got:.6g} want {self.want:.6g}, max abs err {self.max_abs:.3g} "
                f"(rel {self.max_rel:.3g}) {'>' if elementwise > 1 else '<='} allowed {self.allowed:.3g} "
                f"({elementwise:.3g}x){extra}")

    def sort_key(self):
        return (self.step, KIND_ORDER.index(self.kind), self.name, self.rank)


def check_tensor(*, kind: str, name: str, step: int, rank: int, got: torch.Tensor, ref64: torch.Tensor,
                 ref_lp: torch.Tensor, dtype: torch.dtype, offset: tuple[int, ...] = (),
                 ref_alt: torch.Tensor | None = None, extra_allowed: float = 0.0, dof: int = 0,
                 ref_samples: Sequence[torch.Tensor] = (), grad_dof: float | None = None,
                 grad_noise: PieceNoise | None = None, summed_over: int = 1) -> TensorCheck:
    """Judge `got` (a rank's piece) against the float64 reference piece `ref64`.

    `ref_lp` is the same piece from the same-precision reference, `ref_alt` from the perturbed
    float64 reference (optional); `offset` is where the piece starts in the full tensor, so the
    reported index is a reference index. `extra_allowed` is an absolute allowance the caller
    derives from the computation (the loss's, propagated from its output's error). `dof`: the
    number of tokens behind the tensor, which gates the norm-wise bound (NORM_MIN_DOF).
    `ref_samples`: the ensemble's other members (sp_harness.checks.references.SAMPLES), for a
    run below float32: with them the norm-wise bound of a forward or LSE piece is the ensemble's.
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
    err = (got64 - ref64).abs()
    nonfinite = ~torch.isfinite(got64)
    if nonfinite.any():
        err = torch.where(nonfinite, torch.full_like(err, float("inf")), err)
    scale = float(ref64.abs().max())
    # the precision the reference ran in, not its result's dtype: a float32 output against a
    # float64 target promotes the loss to float64, and scaling that by eps32/eps64 would allow 1e7x
    lp = lp_dtype(dtype)
    ref_err = float((ref_lp.detach().to(torch.float64) - ref64).abs().max()) * (eps(dtype) / eps(lp))
    if ref_alt is not None:
        ref_err = max(ref_err, float((ref_alt.detach().to(torch.float64) - ref64).abs().max()))
    # the ensemble's members are legal implementations too: where alt's one draw happens to err
    # little on a cancellation, 'rounded' (a flash-style row sum from the rounded output) may
    # not (docs/tolerance.md, "The max-abs bound")
    for member in ref_samples:
        ref_err = max(ref_err, float((member.detach().to(torch.float64) - ref64).abs().max()))
    # a scalar loss keeps FACTOR: its allowance is propagated from its output's many elements
    # (extra_allowed), which is what a single sample lacks
    factor = FACTOR if kind == "loss" else max_abs_factor(ref64.numel())
    allowed = factor * ref_err + FLOOR_ULPS * floor_eps * max(scale, 1e-30) + extra_allowed
    norm = (_norm_bound(kind, got64 - ref64, ref64, ref_lp, ref_alt, dtype, lp, ref_samples, dof, grad_dof,
                        cancellation, summed_over)
            if dof >= NORM_MIN_DOF else NormBound())
    withheld = 0.0 if nonfinite.any() else vacuous(kind, ref_samples, allowed, scale, norm)
    flat = int(err.reshape(-1).argmax())
    max_abs = float(err.reshape(-1)[flat])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape)) if err.dim() else ()
    if offset:
        index = tuple(i + o for i, o in zip(index, offset, strict=True))
    coherent = (_scale_bound(got64 - ref64, ref64, ref_lp, ref_samples, grad_noise, dtype)
                if kind == "grad" and grad_noise is not None and norm.dof else None)
    if kind == "forward" and dof >= NORM_MIN_DOF and ref_samples:
        coherent = _output_scale(got64 - ref64, ref64, ref_lp, ref_samples, dof, dtype)
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


def _scale_bound(diff: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, samples: Sequence[torch.Tensor],
                 noise: PieceNoise, dtype: torch.dtype) -> GradScaleBound | None:
    """The coherent-scale bound of a grad piece the ensemble judged (its members: the
    run-precision reference and `samples`)."""
    if not torch.isfinite(diff).all():
        return None
    members = [m.detach().to(torch.float64) - ref64 for m in (ref_lp, *samples)]
    return grad_scale_bound(err=diff, member_errs=members, grad=ref64, noise=noise, dtype=dtype)


def _output_scale(diff: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, samples: Sequence[torch.Tensor],
                  tokens: int, dtype: torch.dtype) -> GradScaleBound | None:
    """The coherent-scale bound of a forward output piece of a run below float32
    (sp_harness.compare.output_scale), its members the ensemble's (the run-precision reference
    and `samples`); none where the run is not finite or a member errs by CANCELLATION of the
    piece (the piece is a cancellation, not a scale). float32 is not judged this way: its correct
    runs carry a coherent error shared across tokens that the clustered standard error does not
    see (docs/tolerance.md, "The coherent output scale")."""
    if not torch.isfinite(diff).all():
        return None
    errs = [m.detach().to(torch.float64) - ref64 for m in (ref_lp, *samples)]
    if max(float(e.norm()) for e in errs) >= CANCELLATION * float(ref64.norm()):
        return None
    return output_scale_bound(err=diff, member_errs=errs, out=ref64, tokens=tokens, dtype=dtype)


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


def _norm_bound(kind: str, diff: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, ref_alt: torch.Tensor | None,
                dtype: torch.dtype, lp: torch.dtype, samples: Sequence[torch.Tensor], dof: int,
                grad_dof: float | None = None, cancellation: float = math.inf, summed_over: int = 1) -> NormBound:
    """||got - ref64|| (`diff`) over the piece against its norm-wise bound: the ensemble's
    (ensemble_factor(dof)) for a run below float64 and a check it judges (ENSEMBLE_KINDS), else
    NORM_FACTOR x the two references' error norm (see NORM_FACTOR). A float32 piece takes the
    smaller of the two (FLOAT32_ENSEMBLE_KINDS): each holds on its own, so their false-alarm rates add."""
    # a piece too small for the two-reference norm to concentrate still has the ensemble's, whose
    # factor counts its degrees of freedom however few (the members' own count caps them there)
    small = diff.numel() < NORM_MIN_NUMEL
    if small and not (samples and kind in ENSEMBLE_KINDS):
        return NormBound()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    ref_norm = float(ref64.norm())
    got = float(diff.norm())
    both = ref_alt is not None and not samples and dtype == torch.float32 and kind in FLOAT32_ENSEMBLE_KINDS
    if kind not in ENSEMBLE_KINDS:
        samples = ()
    elif ref_alt is not None and both:
        samples = (ref_alt,)
    ensemble = _ensemble_bound(kind, ref64, ref_lp, ref_alt, dtype, samples, dof, diff.numel(), ref_norm, grad_dof,
                               cancellation, summed_over)
    if small and ensemble is None:
        return NormBound()
    m = 0.0
    if ensemble is not None and not both:
        noise, bound, m = ensemble
    else:
        noise = float((ref_lp.detach().to(torch.float64) - ref64).norm()) * (eps(dtype) / eps(lp))
        if ref_alt is not None:
            noise = max(noise, float((ref_alt.detach().to(torch.float64) - ref64).norm()))
        bound = NORM_FACTOR * noise + NORM_FLOOR_ULPS * eps(dtype) * ref_norm
        if ensemble is not None and ensemble[1] < bound:
            noise, bound, m = ensemble
    if got == 0:
        return NormBound(err=0.0, noise=noise, ref=ref_norm, dof=m, bound=bound)
    return NormBound(ratio=got / bound if bound else float("inf"), err=got, noise=noise, ref=ref_norm, dof=m,
                     bound=bound)


def _ensemble_bound(kind: str, ref64: torch.Tensor, ref_lp: torch.Tensor, ref_alt: torch.Tensor | None,
                    dtype: torch.dtype, samples: Sequence[torch.Tensor], dof: int, most: int,
                    ref_norm: float, grad_dof: float | None = None,
                    cancellation: float = math.inf, summed_over: int = 1) -> tuple[float, float, float] | None:
    """(noise, bound, degrees of freedom) of the ensemble's norm-wise bound over a piece (at most
    `most` degrees of freedom), or None where it has no members or they err by CANCELLATION of
    the piece or more."""
    if not samples:
        return None
    errs = [s.detach().to(torch.float64) - ref64 for s in (ref_lp, *samples)]
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
        m = min(dof, _row_participation(errs))
    m = min(m, most)
    if most < NORM_MIN_NUMEL:
        alt = [] if ref_alt is None else [ref_alt.detach().to(torch.float64) - ref64]
        m = min(m, member_dof([*errs, *alt]))
    floor = plain_floor_units(summed_over) if plain_sum else ENSEMBLE_FLOOR_UNITS
    return noise, math.hypot(ensemble_factor(m) * noise, floor * eps(dtype) / 2 * ref_norm), m


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


def plain_floor_units(summed_over: int) -> float:
    """A plain sum's floor (its noise without alt's term), in units of u ||ref||: sqrt(R) x
    ENSEMBLE_FLOOR_UNITS. The run sums its grad over up to R = `summed_over` ranks in the run
    dtype, rounding R partials and R - 1 running sums: for a coherent sum at most about
    sqrt(3) x 0.58 sqrt(1/R + sum_k=2..R (k/R)^2) unit roundoffs of the piece's norm (1.22 at
    R = 2, 1.44 at 4, 1.82 at 8), which sqrt(R) exceeds; the members round such a reduction
    only at their random splits (docs/tolerance.md, "Plain sums leave alt out; the floor in
    quadrature")."""
    return ENSEMBLE_FLOOR_UNITS * math.sqrt(max(summed_over, 1))


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


def _row_participation(errs: Sequence[torch.Tensor]) -> float:
    """The effective number of tokens behind the members' errors of a piece whose leading dims
    are tokens (a forward output, an input grad): (sum w)^2 / sum w^2 over the rows' mean squared
    error norms w. As many as rows when every token errs alike; fewer where a few dominate (a
    LayerNorm over 3 features whose variance cancels on some tokens: a bf16 ring at hidden 3 erred
    2.6x the members at 134 tokens, a chi ratio of far fewer). Its own estimate is noisy, but only
    where it is small, and there it errs towards a wider bound."""
    if not errs or errs[0].dim() < 2:
        return float("inf")
    return element_participation(torch.stack([e.reshape(-1, e.shape[-1]).square().sum(-1) for e in errs]).mean(0))


def check_bounded(*, kind: str, name: str, step: int, rank: int, got: torch.Tensor | None, want: torch.Tensor,
                  bound: torch.Tensor, offset: tuple[int, ...] = (), scale: ScaleBound | None = None) -> TensorCheck:
    """Judge `got` against `want` element by element, each within its own `bound` (a rounding
    bound derived from the computation, e.g. sp_harness.step.optim_ref). The reported ratio is the
    largest err / bound; `allowed` is the bound at that element. `scale`: a low-precision
    update's coherent scale against its bound (sp_harness.compare.update_scale), judged over the
    whole piece as its `norm_ratio`."""
    want = want.detach().to(torch.float64)
    if got is None or tuple(got.shape) != tuple(want.shape):
        note = "missing" if got is None else f"shape {tuple(got.shape)} != expected {tuple(want.shape)}"
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=float("inf"), max_rel=float("inf"),
                           allowed=0.0, ratio=float("inf"), worst_index=(), got=float("nan"), want=float("nan"),
                           ok=False, note=note)
    if want.numel() == 0:
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=0.0, max_rel=0.0,
                           allowed=0.0, ratio=0.0, worst_index=(), got=0.0, want=0.0, ok=True)
    got64 = got.detach().to(torch.float64)
    err = (got64 - want).abs()
    err = torch.where(torch.isfinite(got64), err, torch.full_like(err, float("inf")))
    bound = bound.detach().to(torch.float64)
    # an exact expectation (bound 0) tolerates exactly 0 error
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    flat = int(ratio.reshape(-1).argmax())
    worst = float(ratio.reshape(-1)[flat])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape)) if err.dim() else ()
    if offset:
        index = tuple(i + o for i, o in zip(index, offset, strict=True))
    magnitude = float(want.abs().max())
    max_abs = float(err.max())
    whole = 0.0 if scale is None else scale.ratio
    return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=max_abs,
                       max_rel=max_abs / magnitude if magnitude else max_abs, allowed=float(bound.reshape(-1)[flat]),
                       ratio=worst, worst_index=index, got=float(got64.reshape(-1)[flat]),
                       want=float(want.reshape(-1)[flat]), ok=worst <= 1.0 and whole <= 1.0,
                       norm_ratio=whole, note="" if scale is None or whole <= 1.0 else scale.describe())
