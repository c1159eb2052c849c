"""Stage: step. The one rank-side step of a sharded model: cut the rank's batch, forward and loss,
backward, the case's grad sync, the optimizer step on the declared grads.

Every job that steps a sharded model goes through `ShardedLoop`: the side-by-side check
(sp_harness.checks.side_by_side_rank), lockstep training (sp_harness.train.rank) and the bare
compute of the benchmark (sp_harness.suites.bench). Each calls the parts in the same order (the
check judges between them, training measures the grad norm and clips), so the ops, and with them
every record, are the same whichever job runs them.

`phase(name)` is called as each part starts ('forward', 'backward', 'grad_sync', 'optimizer'):
the check's collective counter files what follows under that phase.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sp_harness.config.case import Batch
from sp_harness.step.build import Built
from sp_harness.step.inputs import RankBatch, forward_loss, rank_batch
from sp_harness.step.optim_ref import make_optimizer
from sp_harness.step.params import load_declared_grads, zero_declared_grads


def _no_phase(name: str) -> None:
    pass


class ShardedLoop:
    """One rank's sharded model and its optimizer, stepped part by part."""

    def __init__(self, built: Built, *, phase: Callable[[str], None] = _no_phase):
        self.built = built
        self.case, self.sharded, self.ctx, self.params = built.case, built.sharded, built.ctx, built.params
        self.dtype = built.config.torch_dtype
        optimizer, lr = built.config.optimizer, built.config.lr
        assert optimizer is not None and lr is not None, "build resolves optimizer and lr"
        self.opt = make_optimizer(optimizer, lr, self.sharded.module.parameters())
        self.phase = phase

    def local_batch(self, batch: Batch) -> RankBatch:
        """This rank's piece of the global batch, in the run dtype."""
        return rank_batch(batch, self.sharded, self.ctx, self.dtype)

    def forward_backward(self, local: RankBatch, target: torch.Tensor, *,
                         forward_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(local output, this rank's share of the loss); the backward unless `forward_only`
        (inference: what a served model runs, no autograd graph)."""
        self.phase("forward")
        if forward_only:
            with torch.no_grad():
                return forward_loss(self.case, self.sharded, local, target, self.ctx)
        out, loss = forward_loss(self.case, self.sharded, local, target, self.ctx)
        self.phase("backward")
        loss.backward()
        return out, loss

    def sync_grads(self) -> None:
        """The case's own grad sync (its DP / SP reductions)."""
        self.phase("grad_sync")
        self.sharded.sync_grads()

    def load_grads(self) -> None:
        """The declared grads (`Sharded.grad_attr`) become `.grad`, what the optimizer steps on."""
        load_declared_grads(self.params, self.sharded.grad_attr)

    def optimizer_step(self) -> None:
        self.phase("optimizer")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def clear_grads(self) -> None:
        """The declared grads zeroed in place for the next step's accumulation."""
        zero_declared_grads(self.params, self.sharded.grad_attr)

    def step(self, batch: Batch) -> torch.Tensor:
        """One whole step, nothing observed between the parts; returns this rank's loss share."""
        _, loss = self.forward_backward(self.local_batch(batch), batch.target)
        self.sync_grads()
        self.load_grads()
        self.optimizer_step()
        self.clear_grads()
        return loss
