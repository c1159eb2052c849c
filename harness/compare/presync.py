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

- every informative piece fits within its bound: backward is right, the error enters in the
  grad sync (the fitted weights say what the sync should have done);
- some piece fits nowhere: the error enters before the sync; the first such param in backward
  order (its module last to start in forward) is named;
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
    'grad sync', the first failing param, with the weights that would have fit it."""
    ratio: float = 0.0
    """For 'backward': the best fit's max |error| / allowed."""
    weights: tuple[tuple[int, float], ...] = ()
    """For 'grad sync': (rank, weight) of the fit of `param`'s piece on this rank."""
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
            fit = " + ".join(f"rank {r}'s x {w:.4g}" for r, w in self.weights)
            return (f"before the sync every param's grads, combined over the ranks holding its piece, are the "
                    f"reference's (backward is right): {self.param}'s = {fit}")
        return f"the grads before the sync could not place it: {self.note}"


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


def place(*, step: int, rank: int, every: list[PreSyncGrad], order: list[str], failing: list[str],
          refs: Callable[[str], RefPieces | None], precision: Precision) -> Placement:
    """`every`: all ranks' pre-sync grads (`gather`); `order`: this rank's reference param names in
    backward order; `failing`: the params whose grad failed after the sync, first failure first;
    `refs(name)`: this rank's piece of every reference's grad of `name` (None: no piece here)."""
    mine = {g.name: g for g in every if g.rank == rank}
    # a param no grad reached on any rank holding it is evidence only where backward does leave
    # grads in the declared attribute (ZeRO's partitioned grads leave none anywhere)
    leaves_grads = any(g.grad is not None for g in every)
    judged, skipped = 0, []
    fits: dict[str, tuple[tuple[int, float], ...]] = {}
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
        fits[name] = tuple(zip((g.rank for g in holders), weights, strict=True))
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
    shown = next((n for n in failing if n in fits), "")
    if not shown:
        return Placement(stage="unknown", note=f"the params that failed after the sync ({', '.join(failing[:3])}) "
                                                "have no piece that could be judged before it")
    return Placement(stage="grad sync", param=shown, weights=fits[shown])
