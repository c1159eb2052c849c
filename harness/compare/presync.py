"""Stage: compare. Placing a param-grad failure before or after the grad sync.

When the forward, the loss and the input grads are right and a param grad is wrong, the error
entered in backward or in the case's grad sync (`Sharded.sync_grads`: megatron's
finalize_model_grads, DeepSpeed's engine, a hand-written all-reduce). The engine keeps every
rank's grads as backward left them, before that sync (`snapshot`), and asks, per reference param
piece: can ANY linear combination of the pre-sync grads of the ranks holding that piece give
the reference's grad? Every grad sync a framework ships is linear in those grads (a sum over the
SP ranks, a mean over DP, a wrong group's sum, a missing one: weights 1, 1/dp, 0), and how a
rank's share relates to the reference depends on the case's loss normalisation, which the engine
does not know. A least-squares fit of one weight per holder needs neither: it is exact whenever
only the sync is wrong (whatever weights the right sync would use), and it cannot succeed
where a holder's grad is already wrong in shape (a wrong router count, a detached all-to-all's
zeros), since then no weights reproduce the reference. So:

- every informative piece fits within its bound, and a failing param's grad after the sync is
  beyond its bound from that fit: backward is right and the sync moved the grad where it should
  not have, so the error enters in the grad sync (the fitted weights say what it should have done);
- some piece fits nowhere: the error enters before the sync; the first such param in backward
  order (its module last to start in forward) is named;
- every piece fits and every failing param's grad after the sync is within its bound of its fit:
  the sync added nothing the dtype resolves, yet the grads are as wrong before it as after (a
  bfloat16 loss error below the loss's resolution shows first in the grads: megatron's label
  smoothing over the local vocab shard). Neither stage is shown: UNKNOWN, with those numbers;
- no piece can be judged (DTensor grads, which the framework syncs inside backward; pieces with
  no more elements than a few times their holders, where any weights fit): UNKNOWN, never a guess.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sp_harness.compare.tolerance import RefPieces, check_tensor
from sp_harness.step.precision import Precision

MIN_ELEMENTS_PER_HOLDER = 4
"""A piece is informative only with at least this many elements per holder: with n holders an
n-weight fit reproduces any n-element reference, so a small bias would 'fit' whatever backward did."""


@dataclass(kw_only=True, frozen=True)
class PreSyncGrad:
    """One rank's grad of one param as backward left it, before the case's grad sync."""

    rank: int
    name: str
    """The reference param's name."""
    piece: str
    """A digest of which reference elements the rank holds: ranks with the same digest hold the
    same piece, and their grads are what a sync combines."""
    grad: torch.Tensor | None
    """float64 on the CPU, in the piece's shape; None where backward left no grad."""


@dataclass(kw_only=True, frozen=True)
class Placement:
    stage: str
    """'grad sync' (every informative piece's pre-sync grads combine into the reference's),
    'backward' (one does not), or 'unknown' (none could be judged: `note` says why)."""
    param: str = ""
    """For 'backward', the first param (backward order) whose pre-sync grads fit nowhere; for
    'grad sync', the first failing param the sync moved beyond its bound from its fit, with the
    weights of that fit; for 'unknown' where every failing param fit and none was moved so, the
    first of them (`note` has its numbers)."""
    ratio: float = 0.0
    """For 'backward': the best fit's max |error| / allowed."""
    weights: tuple[tuple[int, float], ...] = ()
    """For 'grad sync': (rank, weight) of the fit of `param`'s piece on this rank."""
    moved: float = 0.0
    """For 'grad sync': how far the sync's result lies from that fit, in units of the grad's bound
    (above 1: the sync, not backward, put the error there)."""
    note: str = ""

    def describe(self) -> str:
        if self.stage == "backward" and self.note == "no grad":
            return (f"before the grad sync no grad reached {self.param} on any rank holding its piece, where the "
                    f"reference's is nonzero: the error enters in backward (a detached exchange, say)")
        if self.stage == "backward":
            return (f"before the grad sync, {self.param}'s grads on the ranks holding its piece combine into the "
                    f"reference's with no weights ({self.ratio:.3g}x its bound at the best fit): the error enters "
                    f"in backward (or a forward value only backward reads)")
        if self.stage == "grad sync":
            return (f"before the sync every param's grads, combined over the ranks holding its piece, are the "
                    f"reference's (backward is right): {self.param}'s = {_weights(self.weights)}, and the sync's "
                    f"result is {self.moved:.3g}x its bound away from that")
        return f"the grads before the sync could not place it: {self.note}"


def _weights(weights: tuple[tuple[int, float], ...]) -> str:
    return " + ".join(f"rank {r}'s x {w:.4g}" for r, w in weights)


def _informative(want: RefPieces) -> bool:
    """Whether the reference grad is more than rounding (a key bias's grad is zero in exact
    arithmetic: any weights 'fit' it, and naming weights for it says nothing)."""
    size = float(want.r64.abs().max()) if want.r64.numel() else 0.0
    return size > 16 * float((want.lp.to(torch.float64) - want.r64).abs().max()) and size > 0.0


def piece_digest(index: torch.Tensor) -> str:
    """`index`: the piece of arange(numel).view(shape) the rank holds."""
    return hashlib.sha1(index.contiguous().view(-1).to(torch.int64).numpy().tobytes()).hexdigest()


def gather(mine: list[PreSyncGrad]) -> list[PreSyncGrad]:
    """Every rank's pre-sync grads (the engine's bookkeeping collective: all ranks call it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(mine)
    every: list[list[PreSyncGrad] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [g for grads in every for g in grads or ()]


def fit(grads: list[torch.Tensor], want: torch.Tensor) -> tuple[torch.Tensor, tuple[float, ...]]:
    """The least-squares combination sum_i w_i grads[i] closest to `want`, and the weights."""
    cols = torch.stack([g.reshape(-1) for g in grads], dim=1).to("cpu", torch.float64)
    # an SVD driver: holders often hold identical grads (megatron's TP ranks, whose sequence
    # scatter's backward all-gathers the position embedding's), so the columns are rank-deficient;
    # lstsq's default driver returned a solution 0.31 off (norm 0.50) where 0.5 g0 + 0.5 g2 is exact
    w = torch.linalg.lstsq(cols, want.reshape(-1, 1).to("cpu", torch.float64), driver="gelsd").solution
    return (cols @ w).reshape(want.shape).to(want.device), tuple(float(x) for x in w.view(-1))


@dataclass(frozen=True)
class _Fit:
    weights: tuple[tuple[int, float], ...]
    got: torch.Tensor
    """The fitted combination of the holders' pre-sync grads."""
    ratio: float
    """Its max |error| / allowed."""
    holders: int


def place(*, step: int, rank: int, every: list[PreSyncGrad], order: list[str], failing: list[str],
          refs: Callable[[str], RefPieces | None], after: Callable[[str], torch.Tensor | None],
          precision: Precision) -> Placement:
    """`every`: all ranks' pre-sync grads (`gather`); `order`: this rank's reference param names in
    backward order; `failing`: the params whose grad failed after the sync, first failure first;
    `refs(name)`: this rank's piece of every reference's grad of `name` (None: no piece here);
    `after(name)`: this rank's grad of `name` after the sync, in its piece's shape (None: no grad)."""
    mine = {g.name: g for g in every if g.rank == rank}
    # a param no grad reached on any rank holding it is evidence only where backward does leave
    # grads in the declared attribute (ZeRO's partitioned grads leave none anywhere)
    leaves_grads = any(g.grad is not None for g in every)
    judged, skipped = 0, []
    fits: dict[str, _Fit] = {}
    wrong: list[Placement] = []
    """Pieces that fit nowhere, in backward order."""
    for name in order:
        own = mine.get(name)
        want = refs(name)
        if own is None or want is None:
            continue
        holders = [g for g in every if g.name == name and g.piece == own.piece]
        if not _informative(want) or want.r64.numel() < MIN_ELEMENTS_PER_HOLDER * len(holders):
            continue
        if leaves_grads and all(g.grad is None for g in holders):
            judged += 1
            wrong.append(Placement(stage="backward", param=name, ratio=float("inf"), note="no grad"))
            continue
        if any(g.grad is None for g in holders):
            skipped.append(f"{name} (no grad after backward on some rank)")
            continue
        grads = [g.grad for g in holders if g.grad is not None]
        got, weights = fit(grads, want.r64)
        chk = check_tensor(kind="grad", name=name, step=step, rank=rank, got=got, refs=want, precision=precision,
                           summed_over=len(holders))
        judged += 1
        if not chk.ok:
            wrong.append(Placement(stage="backward", param=name, ratio=chk.ratio))
            continue
        fits[name] = _Fit(weights=tuple(zip((g.rank for g in holders), weights, strict=True)), got=got,
                          ratio=chk.ratio, holders=len(holders))
    # the test calibrates itself: a param that is right after the sync must fit before it. One
    # that does not (megatron's position embedding at DP 2 x TP 2, in a correct run) says these
    # grads are not what this framework's sync combines, and nothing is placed by them
    failed = set(failing)
    right_after = [w.param for w in wrong if w.param not in failed]
    if right_after:
        return Placement(stage="unknown", note=(
            f"{right_after[0]}'s grads before the sync combine into the reference's with no weights, yet it is "
            f"right after the sync: the grads as backward left them are not what this framework's sync combines"))
    if wrong:
        return wrong[0]
    if not judged:
        why = "; ".join(skipped) or ("no param piece could be judged (each has under 4 elements per rank holding it, "
                                      "a reference grad of rounding only, or DTensor grads)")
        return Placement(stage="unknown", note=why)
    shown = [n for n in failing if n in fits]
    if not shown:
        return Placement(stage="unknown", note=f"the params that failed after the sync ({', '.join(failing[:3])}) "
                                                "have no piece that could be judged before it")
    # a fit within its bound only says backward's grads are not shown wrong: the sync is shown
    # wrong only where it moved a grad beyond that bound from the fit. A right sync stays within
    # it whatever the grads were, so an error already in them (below what the fit's bound
    # resolves) must not be read as the sync's
    moves = []
    for name in shown:
        want = refs(name)
        assert want is not None, "a fitted param has its reference piece"
        move = _moved(name, fits[name], after(name), want, step=step, rank=rank, precision=precision)
        if move.ratio > 1.0:
            return Placement(stage="grad sync", param=name, weights=fits[name].weights, moved=move.ratio)
        moves.append((name, want, move))
    name, want, move = moves[0]
    return Placement(stage="unknown", param=name, note=_not_shown(name, fits[name], move, want, precision))


@dataclass(frozen=True)
class _Move:
    after: torch.Tensor
    """The grad after the sync, float64 in the fit's shape (zeros where the sync left none)."""
    ratio: float
    """max |after - fit| / the grad's allowed error."""
    size: float
    """max |after - fit|."""


def _moved(name: str, fitted: _Fit, got: torch.Tensor | None, want: RefPieces, *, step: int, rank: int,
           precision: Precision) -> _Move:
    """How far the sync's result lies from the fit, judged as an error on the reference with the
    grad's own bound (no grad after the sync: the sync dropped it all)."""
    after = torch.zeros_like(fitted.got) if got is None else got.detach().to(fitted.got.device, torch.float64)
    if after.numel() != fitted.got.numel():
        return _Move(after=fitted.got, ratio=float("inf"), size=float("inf"))  # the sync changed its shape
    after = after.reshape(fitted.got.shape)
    chk = check_tensor(kind="grad", name=name, step=step, rank=rank, got=want.r64 + (after - fitted.got),
                       refs=want, precision=precision, summed_over=fitted.holders)
    return _Move(after=after, ratio=chk.ratio, size=chk.max_abs)


def _not_shown(name: str, fitted: _Fit, move: _Move, want: RefPieces, precision: Precision) -> str:
    """Why neither the sync nor backward is named: the numbers that show neither."""
    ref = want.r64.to(torch.float64)
    before, after = float((fitted.got - ref).norm()), float((move.after - ref).norm())
    dtype = str(precision.dtype).removeprefix("torch.")
    return (f"{name}'s grads before the sync, at their best fit ({_weights(fitted.weights)}), are already off the "
            f"reference by an error norm of {before:.3g} ({fitted.ratio:.3g}x its bound at the worst element), and "
            f"by {after:.3g} after it; the sync's result is within {move.ratio:.3g}x that bound of the fit (at most "
            f"{move.size:.3g} off it): within what {dtype} resolves, the sync added no error and the fit shows none "
            f"entering in backward")
