"""Stage: checks. Rank side: the three references of a side-by-side check, each computed once
per example, in a process the code under test never ran in.

The float64 reference, the run-precision reference and the perturbed float64 reference (see
sp_harness.compare.tolerance) are the same for every rank of a job: the global batch, the params
the sharded run holds (re-anchored each step). Each is computed on one rank only (`owner`: by
cost, to the least loaded rank) and broadcast (one pickled header, one flat float64 buffer, exact
for every run dtype), so a job on W ranks does each reference once instead of W times.

Where they are computed: by default in the rank's reference process (sp_harness.checks.refproc),
a child of the rank that imports the case and builds its references from the case's factory in a
one-rank world of its own, and never calls the sharded factory. Whatever the code under test
changes process-wide (a library that registers its SP attention as a framework's global
attention function, a monkeypatch, a framework's global parallel state set up for TP=2) cannot
reach the references there. `Inline` computes them in the rank itself (the profiler times their
parts there). The reference process also lets each rank run its sharded pass while its
reference computes.

Localising a FAIL needs every reference's module trace on the failing rank: there, and only then,
each reference is recomputed with its modules traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from sp_harness.capture.trace import Recorder, Trace
from sp_harness.compare.dof import (
    GRAD_DOF_SHARE,
    TokenSide,
    bias_grad_dof,
    element_participation,
    token_dof,
    token_side,
    weight_grad_dof,
)
from sp_harness.compare.grad_scale import PieceNoise, bias_share, norm_weight_share, sums_to_zero, weight_share
from sp_harness.config.case import Batch, Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.step.adversary import ReorderAdversary
from sp_harness.step.build import cast_floating
from sp_harness.step.precision import precision_of
from sp_harness.step.reference import LinearTerms, RefStep, reference_pass
from sp_harness.step.rounding import RoundedResults, RoundingNoise, perturb_

KINDS = ("r64", "lp", "alt")
"""The three references every check has (sp_harness.compare.tolerance)."""
SAMPLES = ("rounded",)
"""The ensemble's members this module computes, where the run's Precision has them (kinds_for):
with `lp`, the ensemble whose largest error norm bounds the sharded run's forward outputs, LSEs, grads and
input grads (sp_harness.compare.tolerance.ensemble_factor, ENSEMBLE_KINDS). 'rounded' is the model at the next finer
precision with every op's result rounded to the run dtype (sp_harness.step.rounding.
RoundedResults) under the sharded side's legal orders (every reduction split over at most
world-size parts, each rounded to the run dtype: a collective's sum): another legal kernel
choice than this CPU's fused ones."""
COST = {"alt": 3.0, "lp": 1.5, "r64": 1.0, "rounded": 1.3}
"""Relative cost of one pass: the perturbed reference rounds every op's inputs and result and adds
a summation-order error (order_error: an extra |A||B| matmul for the walk, two more for float32's
sequential model) in float64; the run-precision one adds that
error at its own precision (not below float32: platform_noise); the float64 one is a plain pass;
the ensemble's member is a float32 pass under two dispatch modes (1.24x a float64 pass at hidden
256, seq 512, 4 layers, one thread)."""


def kinds_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The references a run in `dtype` computes: the three, and its Precision's members."""
    members = precision_of(dtype).members
    assert set(members) <= set(SAMPLES), f"a member this module cannot compute: {members}"
    return KINDS + members


def owner(which: str, world_size: int, kinds: tuple[str, ...] = KINDS) -> int:
    """The rank that computes reference `which`: the most expensive first, each to the least
    loaded rank (ties to the lowest), so at 2 ranks the perturbed reference runs alone."""
    load = [0.0] * world_size
    placed = {}
    for kind in sorted(kinds, key=lambda k: -COST[k]):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        placed[kind] = rank
        load[rank] += COST[kind]
    return placed[which]


def matmul_input_precision(config: CheckConfig, device: torch.device) -> float | None:
    """Relative precision float32 matmul inputs are rounded to on this platform, if coarser than
    float32: TF32 (2**-10) under `--adversary reorder-tf32`, or on a GPU whose
    `torch.get_float32_matmul_precision()` is 'high' (TF32) or 'medium' (bfloat16, 2**-7)."""
    if config.torch_dtype != torch.float32:
        return None
    if config.adversary == "reorder-tf32":
        return 2.0 ** -10
    if device.type == "cuda":
        return {"high": 2.0 ** -10, "medium": 2.0 ** -7}.get(torch.get_float32_matmul_precision())
    return None


def platform_noise(config: CheckConfig) -> contextlib.AbstractContextManager:
    """The mode the same-precision reference runs under: its matmuls (and, for float32, one-dim
    sums) with a random summation-order error (sp_harness.step.adversary.order_error at its
    accumulator's precision: the worst-order walk, float32's the sequential model), so its error
    is what a less accurate legal kernel would make, not what this CPU's happens to;
    TF32 under `--adversary reorder-tf32` (a platform setting: both sides). None below float32:
    there the accumulator is float32, and its order error, 1e-4 of the run-dtype rounding of
    every result it would be added to, is not worth a matmul per matmul (Precision.order_noise)."""
    precision = precision_of(config.torch_dtype)
    if not precision.order_noise:
        return contextlib.nullcontext()
    return ReorderAdversary(config.seed + 1, reorder=False, order_noise=True, tf32=config.adversary == "reorder-tf32",
                            walk=precision.walk)


@contextlib.contextmanager
def sample_mode(config: CheckConfig, which: str) -> Iterator[None]:
    """The mode an ensemble reference (SAMPLES) runs under: every op's result rounded to the run
    dtype, and the sharded side's legal orders (every matmul and sum split into at most
    world-size parts, each rounded to the run dtype and summed in it in a random order: a
    reduction split over the ranks and finished by a collective). No order error, as for
    the run-precision reference below float32 (platform_noise says why)."""
    assert which in SAMPLES, which
    orders = ReorderAdversary(config.seed + 8, reorder=True, order_noise=False, tf32=config.adversary == "reorder-tf32",
                              partials=max(2, config.world_size), partial_dtype=config.torch_dtype)
    # the rounding mode entered last: it sees each op first and rounds what the order mode returns
    with orders, RoundedResults(config.torch_dtype, torch.Generator().manual_seed(config.seed + 9)):
        yield


@dataclass(kw_only=True, frozen=True)
class LinearPiece:
    """One rank's piece of an nn.Linear's weight or bias grad, as a block of the reference
    param's rows (and columns): what the float64 reference derives its degrees of freedom for."""

    rank: int
    name: str
    """The reference param's name (`<module>.weight` or `<module>.bias`)."""
    rows: torch.Tensor
    cols: torch.Tensor | None
    """None for a bias."""


@dataclass(kw_only=True)
class RefResult:
    """One reference's step: its outputs and grads, and its param grads by reference name."""

    step: RefStep
    grads: dict[str, torch.Tensor | None]
    grad_noise: dict[tuple[int, str], PieceNoise] = field(default_factory=dict)
    """The float64 reference's, in a run with an ensemble: each (rank, param name) LinearPiece's
    degrees of freedom (sp_harness.compare.dof.weight_grad_dof, bias_grad_dof) and its
    noise's share along its grad (sp_harness.compare.grad_scale)."""


def piece_noise(terms: LinearTerms, pieces: Iterable[LinearPiece],
                grads: dict[str, torch.Tensor | None]) -> dict[tuple[int, str], PieceNoise]:
    """Each piece's degrees of freedom and the share of its noise along its exact grad (from
    `grads`, the float64 reference's), from the recorded per-token terms of its Linear (pieces of
    a module the reference has no nn.Linear for, or that got no grad, have none)."""
    inputs, out_grads = terms.terms()
    noise: dict[tuple[int, str], PieceNoise] = {}
    sides: dict[tuple, TokenSide] = {}
    element_sq: dict[str, torch.Tensor] = {}

    def side(module: str, which: str, at: torch.Tensor) -> TokenSide:
        """One side's statistics, once per module and index set (TP ranks share the unsplit
        side, DP replicas both)."""
        key = (module, which, tuple(at.tolist()))
        if key not in sides:
            v = inputs[module] if which == "x" else out_grads[module]
            sides[key] = token_side(v[:, _contiguous(at)])
        return sides[key]

    def derive(piece: LinearPiece, module: str, grad: torch.Tensor) -> PieceNoise:
        rows = _contiguous(piece.rows)
        if piece.cols is None and module in terms.norms:
            # a norm's weight grad sums dy_t * x^_t, its bias grad dy_t: errors elementwise (its
            # elements' variances) or a sum of one vector per token (per-token factors, and the
            # residual stream's grad errs as whole vectors): the fewer degrees of freedom, never
            # more than a quarter of the tokens (the rule they replace, which the campaigns
            # validated for norm params; counting a norm bias's elements alone, 78 where the rule
            # gave 26, false-alarmed at 1.15x)
            dy = out_grads[module][:, rows].to(torch.float64)
            xhat = inputs[module][:, rows] if piece.name.endswith(".weight") else torch.ones_like(dy)
            w = dy * xhat
            dof = min(element_participation(w.square().sum(0)), token_dof(token_side(w)), w.shape[0] * GRAD_DOF_SHARE)
            return PieceNoise(dof=dof, share=norm_weight_share(dy, xhat, grad[rows]))
        if piece.cols is None:
            if module not in element_sq:
                element_sq[module] = out_grads[module].square().sum(0)
            variances = element_sq[module][rows]
            g_rows = out_grads[module][:, rows]
            share = 1.0 if sums_to_zero(g_rows, grad[rows]) else bias_share(variances, grad[rows], g_rows)
            # the fewer of elementwise and whole-vector errors' counts (dof.bias_grad_dof):
            # element participation alone reached err / noise 2.19 at 459 degrees of freedom on a
            # correct fc1 bias (ratio 0.82; ulysses-gpt --seed 5854, `default` kernels); the token
            # side is the one the weight piece of the same rows uses
            return PieceNoise(dof=bias_grad_dof(g_rows, side(module, "g", piece.rows)), share=share)
        x, g = side(module, "x", piece.cols), side(module, "g", piece.rows)
        terms_sq = float((g.sq * x.sq).sum())  # sum_t |g_t|^2 |x_t|^2 over every token
        # tr C over every token, scaled to the sample the projection is summed over
        trace = 2.0 * terms_sq * x.sample.shape[0] / x.sq.shape[0]
        weight = grad[rows][:, _contiguous(piece.cols)]
        share = (1.0 if sums_to_zero(out_grads[module][:, rows], weight)
                 else weight_share(x.sample, g.sample, weight, trace))
        norm = float(weight.norm())
        # an attention's projections keep the perturbed reference's term (cancellation inf)
        plain = norm > 0 and module not in terms.in_attention
        return PieceNoise(dof=weight_grad_dof(x, g), share=share,
                          cancellation=terms_sq ** 0.5 / norm if plain else float("inf"))

    derived: dict[tuple, PieceNoise] = {}
    for piece in pieces:
        module = piece.name.rpartition(".")[0]
        grad = grads.get(piece.name)
        if module not in inputs or grad is None:
            continue
        # DP replicas (and every rank's replicated norm) hold the same piece: derived once
        key = (piece.name, tuple(piece.rows.tolist()), None if piece.cols is None else tuple(piece.cols.tolist()))
        if key not in derived:
            derived[key] = derive(piece, module, grad)
        noise[(piece.rank, piece.name)] = derived[key]
    return noise


def _contiguous(at: torch.Tensor) -> torch.Tensor | slice:
    """`at` as a slice where it is a run of consecutive indices (a view, not a copy)."""
    if len(at) and int(at[-1]) - int(at[0]) + 1 == len(at) and bool((at.diff() == 1).all()):
        return slice(int(at[0]), int(at[-1]) + 1)
    return at


@dataclass(kw_only=True)
class References:
    """float64, the run's own precision, and float64 with every op's inputs and result perturbed,
    computed in this process."""

    r64: nn.Module
    lp: nn.Module
    alt: nn.Module
    alt_noise: RoundingNoise
    alt_gen: torch.Generator
    dtype: torch.dtype
    """The run dtype."""
    platform: contextlib.AbstractContextManager
    """The order-noise mode the run-precision reference runs under."""
    config: CheckConfig
    rounded: nn.Module | None = None
    """The 'rounded' ensemble reference (SAMPLES), at the precision above the run's; None where
    the run has no ensemble (kinds_for)."""
    forward_only: bool = False
    """A forward-only check: the references skip backward (`reference_pass(backward=False)`)."""

    def model(self, which: str) -> nn.Module:
        return getattr(self, which)

    def anchor(self, which: str, full: dict[str, torch.Tensor]) -> None:
        """Load the sharded run's current params (sp_harness.step.anchor) into one reference."""
        params = dict(self.model(which).named_parameters())
        with torch.no_grad():
            for name, value in full.items():
                params[name].copy_(value)
                if which == "alt":
                    perturb_(params[name], torch.finfo(self.dtype).eps, self.alt_gen)

    def compute(self, which: str, full: dict[str, torch.Tensor], case: Case, batch: Batch,
                pieces: tuple[LinearPiece, ...] = ()) -> RefResult:
        """Reference `which` anchored at `full`, one forward and backward on the global batch;
        the float64 one also derives `pieces`' degrees of freedom where the run has an ensemble."""
        model = self.model(which)
        self.anchor(which, full)
        model.zero_grad(set_to_none=True)  # a fresh grad tensor per step: results handed out stay as they were
        backward = not self.forward_only
        terms = LinearTerms(model) if which == "r64" and pieces and backward and self.rounded is not None else None
        if which == "r64":
            step = reference_pass(model, case, batch, torch.float64, backward=backward, terms=terms)
        elif which == "lp":
            with self.platform:
                step = reference_pass(model, case, batch, precision_of(self.dtype).reference, backward=backward)
        elif which in SAMPLES:
            member_dtype = precision_of(self.dtype).member_dtype
            assert member_dtype is not None, f"{self.dtype} has no ensemble members"
            with sample_mode(self.config, which):
                step = reference_pass(model, case, batch, member_dtype, backward=backward)
        else:
            step = reference_pass(model, case, batch, torch.float64, noise=self.alt_noise, backward=backward)
            if not self.alt_noise.within_range and not bool(torch.isfinite(step.loss).all()):
                # the noise pushed a sentinel (a mask's finfo.min) past the range: this pass again,
                # and every later one of this check, with perturbed values kept finite
                self.alt_noise.within_range = True
                self.anchor(which, full)
                model.zero_grad(set_to_none=True)
                step = reference_pass(model, case, batch, torch.float64, noise=self.alt_noise, backward=backward)
        grads = {n: p.grad for n, p in model.named_parameters()}
        return RefResult(step=step, grads=grads,
                         grad_noise=piece_noise(terms, pieces, grads) if terms is not None else {})

    def trace(self, which: str, full: dict[str, torch.Tensor], case: Case, batch: Batch,
              skip: frozenset[str]) -> Trace:
        """Reference `which` recomputed with every module's output and input grad recorded."""
        recorder = Recorder(self.model(which), skip)
        try:
            self.compute(which, full, case, batch)
        finally:
            recorder.remove()
        return recorder.snapshot()


def make_references(reference: nn.Module, build_copy, config: CheckConfig, device: torch.device) -> References:
    """The three references: `reference` itself (float64) and two more from `build_copy()` (the
    case's factory, loaded with the reference's state), never deep copies: a framework's module
    may hold what cannot be copied (process groups)."""
    dtype = config.torch_dtype
    precision = precision_of(dtype)
    alt_gen = torch.Generator().manual_seed(config.seed + 104729)
    matmul_input_rel = matmul_input_precision(config, device)
    noise = RoundingNoise(torch.finfo(dtype).eps, alt_gen, torch.finfo(precision.accumulator).eps, matmul_input_rel,
                          precision.magnitude, walk=precision.walk)
    return References(r64=reference, lp=cast_floating(build_copy(), precision.reference), alt=build_copy(),
                      alt_noise=noise, alt_gen=alt_gen, dtype=dtype, platform=platform_noise(config),
                      config=config,
                      rounded=(cast_floating(build_copy(), precision.member_dtype)
                               if precision.member_dtype is not None else None),
                      forward_only=bool(config.forward_only))


class Computes(Protocol):
    """Where a rank's own references are computed: `start` hands over the work, `finish` waits
    for it, so the rank may run its sharded pass in between."""

    def start(self, kinds: tuple[str, ...], full: dict[str, torch.Tensor], batch: Batch,
              pieces: tuple[LinearPiece, ...]) -> None: ...

    def finish(self) -> dict[str, RefResult]: ...

    def traces(self, full: dict[str, torch.Tensor], batch: Batch, skip: frozenset[str]) -> dict[str, Trace]: ...


class Inline:
    """The references computed in the rank's own process, when asked."""

    def __init__(self, refs: References, case: Case):
        self.refs, self.case = refs, case
        self._done: dict[str, RefResult] = {}

    def start(self, kinds: tuple[str, ...], full: dict[str, torch.Tensor], batch: Batch,
              pieces: tuple[LinearPiece, ...]) -> None:
        self._done = {w: self.refs.compute(w, full, self.case, batch, pieces) for w in kinds}

    def finish(self) -> dict[str, RefResult]:
        done, self._done = self._done, {}
        return done

    def traces(self, full: dict[str, torch.Tensor], batch: Batch, skip: frozenset[str]) -> dict[str, Trace]:
        return {w: self.refs.trace(w, full, self.case, batch, skip) for w in KINDS}


class Shared:
    """Every reference's step on every rank: each computed by its owner and broadcast. `pieces`:
    every rank's LinearPieces (the owner of the float64 reference derives all of theirs)."""

    def __init__(self, computes: Computes, device: torch.device, dtype: torch.dtype,
                 pieces: tuple[LinearPiece, ...] = ()):
        self.computes, self.device, self.pieces = computes, device, pieces
        self.kinds = kinds_for(dtype)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.mine = tuple(w for w in self.kinds if owner(w, self.world_size, self.kinds) == self.rank)

    def start(self, full: dict[str, torch.Tensor], batch: Batch) -> None:
        self.computes.start(self.mine, full, batch, self.pieces)

    def finish(self) -> dict[str, RefResult]:
        """A collective: every rank calls it after `start`, in the same order."""
        done = self.computes.finish()
        if self.world_size == 1:
            return done
        return {w: _share(done.get(w), owner(w, self.world_size, self.kinds), self.device) for w in self.kinds}

    def traces(self, full: dict[str, torch.Tensor], batch: Batch, skip: frozenset[str]) -> dict[str, Trace]:
        return self.computes.traces(full, batch, skip)


def _tensors(result: RefResult) -> list[torch.Tensor | None]:
    """A step's tensors in a fixed order: out, loss, out_grad, input grads (by name), attention
    log-sum-exps (by module name), param grads (by name)."""
    step = result.step
    return ([step.out, step.loss, step.out_grad] + [step.input_grads[k] for k in sorted(step.input_grads)]
            + [step.lse[k] for k in sorted(step.lse)] + [result.grads[k] for k in sorted(result.grads)])


_Meta = tuple[tuple[int, ...], torch.dtype] | None
"""One tensor of a shared step: its shape and dtype, None for a None."""


def _share(result: RefResult | None, src: int, device: torch.device) -> RefResult:
    """Broadcast `src`'s reference result to every rank."""
    header: list[tuple[list[str], list[str], list[str], list[_Meta], dict[tuple[int, str], PieceNoise]] | None]
    if result is not None:
        tensors = _tensors(result)
        header = [(sorted(result.step.input_grads), sorted(result.step.lse), sorted(result.grads),
                   [None if t is None else (tuple(t.shape), t.dtype) for t in tensors], result.grad_noise)]
        flat = _flat(t for t in tensors if t is not None)
    else:
        header = [None]
    dist.broadcast_object_list(header, src=src, device=device if device.type == "cuda" else None)
    shared = header[0]
    assert shared is not None, f"the owner (rank {src}) of a reference sent no result"
    names, lse_names, param_names, metas, grad_noise = shared
    if result is None:
        flat = torch.empty(sum(_numel(m[0]) for m in metas if m is not None), dtype=torch.float64, device=device)
    dist.broadcast(flat, src=src)
    if result is not None:
        return result
    tensors, at = [], 0
    for meta in metas:
        if meta is None:
            tensors.append(None)
            continue
        shape, dtype = meta
        n = _numel(shape)
        tensors.append(flat[at:at + n].reshape(shape).to(dtype))
        at += n
    out, loss, out_grad = tensors[:3]
    assert out is not None and loss is not None, "a reference step has an output and a loss"
    at = 3 + len(names)
    # what the owner's RefStep held, entry for entry (a None only where it held one)
    grads = cast(dict[str, torch.Tensor], dict(zip(names, tensors[3:at], strict=True)))
    lse = cast(dict[str, torch.Tensor], dict(zip(lse_names, tensors[at:at + len(lse_names)], strict=True)))
    params = dict(zip(param_names, tensors[at + len(lse_names):], strict=True))
    return RefResult(step=RefStep(out=out, loss=loss, input_grads=grads, out_grad=out_grad, lse=lse), grads=params,
                     grad_noise=grad_noise)


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
