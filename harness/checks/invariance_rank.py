"""Stage: checks. The rank job of the training-step invariance checks
(sp_harness.checks.accumulation_invariance, sp_harness.checks.degree_invariance).

One optimizer step's worth of the case's own step (`Sharded.train_step.accumulate`), on the
training-step check's micro-batches: the grads it leaves and the loss it reports, as full float64
tensors on every rank, each with the max-abs bound the tolerance model holds a correct run to
(`check_tensor`'s `allowed` against the float64 reference). With `single` set, the same step
again from the same params on the whole global batch as one micro-batch. Two correct runs differ
by at most the sum of their bounds (each is that close to the one float64 truth), so the checks
compare the implementation with itself under that sum: a step whose result depends on how the
batch is cut, into micro-batches or over ranks, fails there by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sp_harness.checks.references import KINDS, SAMPLES, RefResult
from sp_harness.checks.side_by_side_rank import _loss_allowance
from sp_harness.checks.train_step_rank import _TrainStepRun
from sp_harness.compare.tolerance import RefPieces, check_tensor, eps
from sp_harness.config.case import Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.step_protocol import MicroBatch
from sp_harness.launch import announce
from sp_harness.launch.wire import STEPS
from sp_harness.step.anchor import gather_full
from sp_harness.step.inputs import batch_generator
from sp_harness.step.params import zero_declared_grads
from sp_harness.step.train_batches import micro_batch


@dataclass(kw_only=True, frozen=True)
class InvariancePayload:
    config: CheckConfig
    single: bool = False
    """Also run the whole global batch as one micro-batch."""
    mask_mesh: tuple[int, int, tuple[int, ...]] | None = None
    """(dp, tp, seq_shards) of the run whose masks to draw: a 1-rank run compared with an n-rank one
    must leave the same tokens without loss. None: this run's own mesh."""


@dataclass(kw_only=True)
class Variant:
    """One accumulation of the case's step, as every rank sees it."""

    loss: float
    loss_bound: float
    grads: dict[str, list[float]] = field(default_factory=dict)
    """Reference name -> the full grad, flattened, float64 values (plain floats: a tensor would
    cross the pipe as shared memory the driver cannot open)."""
    bounds: dict[str, float] = field(default_factory=dict)
    """Reference name -> its max-abs bound against the float64 reference (max over pieces and ranks)."""


@dataclass(kw_only=True)
class InvarianceResult:
    micro: Variant
    """K micro-batches (the config's)."""
    single: Variant | None = None
    """The same global batch as one micro-batch."""


@dataclass
class _GradView:
    """A LocalParam whose `param` is its grad: what `gather_full` assembles."""

    param: torch.Tensor
    dtensor: bool
    spec: object


class _Invariance(_TrainStepRun):
    def __init__(self, payload: InvariancePayload):
        super().__init__(payload.config)
        self.payload = payload

    def _mask_ctx(self):
        if self.payload.mask_mesh is None:
            return self.ctx
        dp, tp, shards = self.payload.mask_mesh
        return dataclasses.replace(self.ctx, dp_ranks=tuple(range(dp)), tp_ranks=tuple(range(tp)),
                                   seq_shards=tuple(shards), dp_rank=0, tp_rank=0)

    def variant(self, micro: list[MicroBatch], refs: dict[str, RefResult], tokens: int) -> Variant:
        reported = self.train.accumulate(micro)
        r64, r_lp, r_alt = (refs[w].step for w in KINDS)
        summed = len(micro) * eps(self.precision.reference) * abs(float(r64.loss))
        out = Variant(loss=float(torch.as_tensor(reported, dtype=torch.float64)),
                      loss_bound=_loss_allowance(r64, r_lp, r_alt, self.dtype) + summed)
        grads = {w: refs[w].grads for w in refs}
        names = sorted({p.spec.ref_name for p in self.params})
        bound = torch.zeros(len(names), dtype=torch.float64)
        views = []
        for p in self.params:
            ref = p.spec.ref_name
            g = self.grad_of(p.param)
            g = torch.zeros_like(p.param) if g is None else g.detach()
            views.append(_GradView(param=g, dtensor=p.dtensor, spec=p.spec))
            g64, glp = grads["r64"][ref], grads["lp"][ref]
            assert g64 is not None and glp is not None, f"the references computed no grad of {ref} (backward ran)"
            got, w64, wlp, _ = p.full_or_piece(g, g64, glp, self.ctx)
            samples = [p.piece_of(grads[w][ref], self.ctx) for w in SAMPLES if w in grads]
            pieces = RefPieces(r64=w64, lp=wlp, alt=p.piece_of(grads["alt"][ref], self.ctx),
                               members=tuple(t for t in samples if t is not None))
            chk = check_tensor(kind="grad", name=ref, step=0, rank=self.ctx.rank, got=got, refs=pieces,
                               precision=self.precision, dof=tokens, summed_over=self.config.world_size)
            i = names.index(ref)
            bound[i] = max(float(bound[i]), chk.allowed)
        if dist.get_world_size() > 1:
            dist.all_reduce(bound, op=dist.ReduceOp.MAX)
        shapes = {n: t.shape for n, t in self.ref64.items()}
        full = gather_full(views, shapes, self.ctx)  # type: ignore[arg-type]
        out.grads = {n: t.reshape(-1).tolist() for n, t in full.items()}
        out.bounds = dict(zip(names, bound.tolist(), strict=True))
        return out

    def clear(self) -> None:
        """The first variant's grads dropped, without a step: the step's own `zero_grad` where it
        has one (a framework's grad buffers), else the declared grads zeroed."""
        zero_grad = getattr(self.train, "zero_grad", None)
        if zero_grad is not None:
            zero_grad()
            return
        for p in self.params:
            p.param.grad = None
        zero_declared_grads(self.params, self.sharded.grad_attr)

    def run(self) -> InvarianceResult:
        if self.payload.single and getattr(self.train, "fixed_micro_batches", False):
            # decided by the step alone: before the references and the first accumulation run
            raise Unsupported(f"case {self.config.case}: its training step fixes its micro-batch count when it is "
                              f"built (TrainStep.fixed_micro_batches), so it cannot accumulate one batch after K")
        announce.phase(STEPS)  # from here on a crash is the step's own (FAIL), not its setup's (ERROR)
        mbs, whole, tokens = self.start_step(0, batch_generator(self.config.seed), self._mask_ctx())
        refs = self._scaled(self.finish_references(), tokens)
        ignore = self.loss_spec.ignore_index
        result = InvarianceResult(micro=self.variant([micro_batch(self.loop.local_batch(b), ignore) for b in mbs],
                                                     refs, tokens))
        if self.payload.single:
            self.clear()
            result.single = self.variant([micro_batch(self.loop.local_batch(whole), ignore)], refs, tokens)
        return result


def run_rank(payload: InvariancePayload) -> InvarianceResult | None:
    """The job: rank 0 returns the variants (every rank holds them; one copy crosses the pipe)."""
    result = _Invariance(payload).run()
    return result if dist.get_rank() == 0 else None
