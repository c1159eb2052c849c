"""Stage: checks. A side-by-side rank's grads as backward left them, before the case's grad sync,
and where they place a param-grad failure (sp_harness.compare.presync): kept every step of a
traced run, gathered from every rank only at a step where some rank's first failure is a grad.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sp_harness.checks.references import RefResult
from sp_harness.compare.presync import Placement, PreSyncGrad, gather, piece_digest, place
from sp_harness.compare.tolerance import RefPieces
from sp_harness.step.build import Built
from sp_harness.step.params import LocalParam, declared_grad
from sp_harness.step.precision import precision_of


def _ancestors(name: str) -> list[str]:
    """'a.b.c' -> ['a', 'a.b']: the modules holding module `name`."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


class BeforeSync:
    """One rank's pre-sync grads and their placement."""

    def __init__(self, built: Built, ref64: dict[str, torch.Tensor], local_pieces: frozenset[str], prefix: str):
        """`local_pieces`: the modules owning TP-sharded params, as the sharded model names them;
        `prefix`: a wrapper's ('module.')."""
        self.built, self.ctx, self.prefix = built, built.ctx, prefix
        self.params = [p for p in built.params if not p.dtensor]
        self.partial = frozenset(n[len(prefix):] for m in local_pieces for n in _ancestors(m)
                                       if n.startswith(prefix) and len(n) > len(prefix)) \
            if self.ctx.tp > 1 else frozenset()
        """At TP > 1, the modules with TP-sharded params below them (first_divergence's `partial`)."""
        self.digests = {p.spec.ref_name: piece_digest(p.piece_of(
            torch.arange(ref64[p.spec.ref_name].numel()).view(ref64[p.spec.ref_name].shape), self.ctx))
            for p in self.params}
        self.grads: list[PreSyncGrad] = []
        """This step's, as backward left them (float64 copies on the CPU)."""

    def keep(self) -> None:
        """Copy the grads backward left, before the sync changes them in place. Plain params only:
        a DTensor's grad is the framework's, synced inside backward."""
        self.grads = []
        for p in self.params:
            g = declared_grad(p.param, self.built.sharded.grad_attr)
            self.grads.append(PreSyncGrad(
                rank=self.ctx.rank, name=p.spec.ref_name, piece=self.digests[p.spec.ref_name],
                grad=None if g is None else g.detach().to("cpu", torch.float64).reshape(p.param.shape).clone()))

    def place(self, step: int, refs: dict[str, RefResult], failing: list[str] | None,
              started: list[str]) -> Placement | None:
        """A collective every rank calls every step of a traced run with a backward, after the grad
        check and before the optimizer step (the declared grads are the sync's result). `failing`:
        this rank's failing param grads at this step where its first failure is one, else None;
        `started`: the modules in the order their forward started (the trace's). None where no
        rank has a param-grad failure to place, or on a rank that has none."""
        if not self.params:  # the same on every rank: no collective to skip
            return None if failing is None else Placement(
                stage="unknown", note="the params are DTensors, whose grads the framework reduces inside backward "
                                      "(FSDP's reduce-scatter): there is no grad before the sync to read")
        if not self._any_rank(failing is not None):
            return None
        every = gather(self.grads)  # every rank takes part, even one with nothing to place
        if failing is None:
            return None
        grads = {w: refs[w].grads for w in refs}
        mine = {p.spec.ref_name: p for p in self.params}

        def pieces(name: str) -> RefPieces | None:
            p, g64, glp = mine.get(name), grads["r64"].get(name), grads["lp"].get(name)
            if p is None or g64 is None or glp is None:
                return None
            alt = grads["alt"].get(name)
            return RefPieces(r64=p.piece_of(g64, self.ctx), lp=p.piece_of(glp, self.ctx),
                             alt=None if alt is None else p.piece_of(alt, self.ctx))

        # backward order: the module whose forward started last runs its backward first
        at = {n: i for i, n in enumerate(started)}

        def when(p: LocalParam) -> int:
            return -at.get(p.local_name.rpartition(".")[0][len(self.prefix):], -1)

        def after(name: str) -> torch.Tensor | None:
            # called before the optimizer step: the declared grads are still the sync's result
            g = declared_grad(mine[name].param, self.built.sharded.grad_attr)
            return None if g is None else g.detach().to("cpu", torch.float64).reshape(mine[name].param.shape)

        order = [p.spec.ref_name for p in sorted(self.params, key=when)]
        return place(step=step, rank=self.ctx.rank, every=every, order=order, failing=failing, refs=pieces,
                     after=after, precision=precision_of(self.built.config.torch_dtype))

    def _any_rank(self, flag: bool) -> bool:
        """Whether any rank says `flag`: the engine's bookkeeping collective, outside the comm
        counter."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.built.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
