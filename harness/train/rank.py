"""Stage: train. Rank side: the job functions a runner calls on every rank: `train_start`
builds the models, `train_steps` advances them, `train_end` drops them.

State lives in the rank process between jobs (one `_Trainer` per process), so the driver can
advance training in chunks and show progress. Each sharded run trains a copy of the reference
alongside it on every rank, on the whole global batch: max |param - reference param| is known
at every step, and the reference's own curve comes from that copy, so the same code works
under torchrun, where there is no one-rank world to run the reference in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist

from sp_harness.config.case import Batch
from sp_harness.config.registry import get_case
from sp_harness.config.step_protocol import TrainStep
from sp_harness.launch import announce
from sp_harness.launch.wire import STEPS
from sp_harness.step.build import Built, build, cast_floating, new_reference
from sp_harness.step.context import rank_device, reference_context
from sp_harness.step.inputs import batch_to, call, global_loss
from sp_harness.step.loop import ShardedLoop
from sp_harness.step.optim_ref import make_optimizer
from sp_harness.step.params import replica_drift
from sp_harness.step.train_batches import micro_batch, micro_batch_count, split_rows
from sp_harness.train.spec import TrainSpec, batch_at, lr_at


@dataclass(kw_only=True, frozen=True)
class Measured:
    """What one run measured at one step (the fields of a record.StepRecord but run/step/lr)."""

    loss: float
    """Global mean loss, before the step's update."""
    grad_norm: float
    """Global grad norm before clipping, replicated parameters counted once."""
    replica_drift: dict[str, float] = field(default_factory=dict)
    """Reference name -> max cross-rank difference of a replicated parameter after the update."""
    max_replica_drift: float = 0.0
    """Max of `replica_drift`."""
    param_err_vs_ref: float = 0.0
    """max |param - reference copy's param| after the update (0.0 for the reference itself)."""
    step_time_s: float
    """Wall time of forward, backward and update."""
    tokens_per_s: float
    """Loss terms (`Case.tokens`) of the global batch per second of `step_time_s`."""


@dataclass(kw_only=True, frozen=True)
class StepResult:
    """One step of a lockstep run, as every rank returns it."""

    step: int
    lr: float
    """LR of this step's update."""
    tokens: int
    """Loss terms in the global batch."""
    run: Measured | None
    """The sharded run; None for a reference-only run."""
    ref: Measured
    """The reference copy trained alongside."""


@dataclass(kw_only=True, frozen=True)
class StartInfo:
    num_params: int
    """Parameters of the reference model."""


def _run_dtype(t, dtype: torch.dtype):
    # the reference copy runs in the run dtype: a float64 input would promote its whole forward
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds else float("nan")


class _Trainer:
    def __init__(self, spec: TrainSpec):
        config = spec.config
        self.spec = spec
        self.case = get_case(config.case)
        self.data_case = get_case(spec.data_case) if spec.data_case else self.case
        self.built: Built | None = None
        if spec.reference_only:
            self.device = rank_device()
            ref = new_reference(self.case, config, reference_context(config, self.device))
            self.ref = cast_floating(ref.to(device=self.device), config.torch_dtype)
        else:
            # a case's own training step clips to the run's max norm (its ctx.config says it)
            built_as = config.replace(clip_grad_norm=spec.clip_grad_norm) if self.case.train_loss else config
            self.built = build(built_as, reference_dtype=config.torch_dtype)
            self.device, self.ref = self.built.device, self.built.reference
            self.loop = ShardedLoop(self.built)
        assert config.optimizer is not None and config.lr is not None, "base_config resolves optimizer and lr"
        self.ref_opt = make_optimizer(config.optimizer, config.lr, self.ref.parameters())
        self.ref_params = dict(self.ref.named_parameters())
        self.step = 0
        announce.phase(STEPS)

    def advance(self) -> StepResult:
        step, spec = self.step, self.spec
        lr = lr_at(spec, step)
        batch = batch_at(self.data_case, spec.config, step, spec.data_seed)
        batch = batch_to(batch, self.device)
        tokens = self.case.tokens(batch.target)
        ref = self._ref_step(batch, lr, tokens)
        run = None if self.built is None else self._sharded_step(batch, lr, tokens)
        self.step += 1
        return StepResult(step=step, lr=lr, tokens=tokens, run=run, ref=ref)

    def _ref_step(self, batch: Batch, lr: float, tokens: int) -> Measured:
        """The reference alongside: one device, the global batch."""
        dtype = self.spec.config.torch_dtype
        inputs = {k: _run_dtype(v, dtype) for k, v in batch.inputs.items()}
        target = _run_dtype(batch.target, dtype)
        t0 = time.perf_counter()
        loss = self.case.loss_sum(call(self.ref, inputs, batch.positional), target) / self.case.tokens(target)
        loss.backward()
        # a tensor: the reference has parameters, and backward gave them grads
        norm = torch.sqrt(cast(torch.Tensor, sum(p.grad.detach().double().pow(2).sum() for p in self.ref.parameters()
                                                 if p.grad is not None)))
        if self.spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.ref.parameters(), self.spec.clip_grad_norm)
        _set_lr(self.ref_opt, lr)
        self.ref_opt.step()
        self.ref_opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        return Measured(loss=float(loss.detach()), grad_norm=float(norm), step_time_s=seconds,
                        tokens_per_s=_per_s(tokens, seconds))

    @property
    def _built(self) -> Built:
        """The sharded side's models; the methods below run only when there is one."""
        assert self.built is not None, "a reference-only run has no sharded model"
        return self.built

    def _own_step(self, batch: Batch, lr: float, tokens: int, train: TrainStep) -> Measured:
        """The case's own training step (`Sharded.train_step`): its accumulation over micro-batches
        of this step's batch, its normalisation, sync, clipping and optimizer; the loss and grad
        norm recorded are the ones it reports."""
        built, loop = self._built, self.loop
        config, ctx = built.config, built.ctx
        assert self.case.train_loss is not None and config.batch is not None, "a case with its own step, resolved"
        batch_dim = self.case.input_layout.batch_dim
        if batch_dim is None or self.case.train_loss.reduction != "token-mean":
            raise ValueError(f"case {config.case}: converge trains a case's own step on a batched input with a "
                             f"token-mean loss (the reference's)")
        num = micro_batch_count(config.batch, config.micro_batches)
        ignore = self.case.train_loss.ignore_index
        t0 = time.perf_counter()
        micro = [micro_batch(loop.local_batch(part), ignore) for part in split_rows(batch, num, ctx.dp, batch_dim)]
        set_lr = getattr(train, "set_lr", None)
        if set_lr is not None:
            set_lr(lr)
        elif train.optimizer is not None:
            _set_lr(train.optimizer, lr)
        else:
            raise ValueError(f"case {config.case}: its training step hides its optimizer (TrainStep.optimizer is None) "
                             f"and has no set_lr(lr), so converge cannot follow its lr schedule")
        loss = float(torch.as_tensor(train.accumulate(micro)))
        grad_norm = float(torch.as_tensor(train.step()))
        seconds = time.perf_counter() - t0
        drift = self._drift()
        return Measured(loss=loss, grad_norm=grad_norm, replica_drift=drift,
                        max_replica_drift=max(drift.values(), default=0.0), param_err_vs_ref=self._param_err(),
                        step_time_s=seconds, tokens_per_s=_per_s(tokens, seconds))

    def _sharded_step(self, batch: Batch, lr: float, tokens: int) -> Measured:
        built, spec, loop = self._built, self.spec, self.loop
        if built.sharded.train_step is not None and self.case.train_loss is not None:
            return self._own_step(batch, lr, tokens, built.sharded.train_step)
        sharded, ctx, params = built.sharded, built.ctx, built.params
        t0 = time.perf_counter()
        _, loss = loop.forward_backward(loop.local_batch(batch), batch.target)
        loop.sync_grads()
        loop.load_grads()
        norm_sq = _grad_norm_sq_local(params, ctx)
        if ctx.tp > 1:
            dist.all_reduce(norm_sq, group=ctx.tp_group)
        grad_norm = float(norm_sq.sqrt())
        if spec.clip_grad_norm is not None:
            self._clip(grad_norm, spec.clip_grad_norm)
        _set_lr(loop.opt, lr)
        loop.optimizer_step()
        loop.clear_grads()
        seconds = time.perf_counter() - t0
        drift = self._drift()
        return Measured(loss=float(global_loss(loss, sharded, ctx)), grad_norm=grad_norm, replica_drift=drift,
                        max_replica_drift=max(drift.values(), default=0.0), param_err_vs_ref=self._param_err(),
                        step_time_s=seconds, tokens_per_s=_per_s(tokens, seconds))

    def _clip(self, grad_norm: float, max_norm: float) -> None:
        sharded = self._built.sharded
        if sharded.clip_grad_norm is not None:
            sharded.clip_grad_norm(max_norm)  # the implementation's own clipping is under test
            return
        coef = min(1.0, max_norm / (grad_norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s formula
        for p in self._built.params:
            if p.param.grad is not None:
                p.param.grad.mul_(coef)

    def _drift(self) -> dict[str, float]:
        ctx, params = self._built.ctx, self._built.params
        by_name: dict[str, float] = {}
        for d in replica_drift(self.step, params, ctx, set(self.case.replicated_hint)):
            by_name[d.name] = max(by_name.get(d.name, 0.0), d.max_abs)
        # replicated params that did not drift are recorded as exact zeros
        for p in params:
            if p.replicated_tp and ctx.tp > 1:
                by_name.setdefault(p.spec.ref_name, 0.0)
        return by_name

    def _param_err(self) -> float:
        ctx = self._built.ctx
        err = torch.zeros((), dtype=torch.float64)
        for p in self._built.params:
            want = p.piece_of(self.ref_params[p.spec.ref_name].detach(), ctx)
            got = p.full(p.param.detach())
            if want.numel():
                err = torch.maximum(err, (got.double() - want.double()).abs().max())
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        return float(err)


def _grad_norm_sq_local(params, ctx) -> torch.Tensor:
    """This rank's share of the squared global grad norm: sharded pieces in full, replicated
    params only on TP rank 0 so that the TP sum counts each once."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.param.grad
        if g is None:
            continue
        g = p.local(g)
        if p.replicated_tp and ctx.tp_rank != 0:
            continue
        total += g.detach().to(torch.float64).pow(2).sum()
    return total


def _set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


_STATE: dict[str, _Trainer] = {}


def train_start(spec: TrainSpec) -> StartInfo:
    _STATE.clear()
    trainer = _STATE["trainer"] = _Trainer(spec)
    return StartInfo(num_params=sum(p.numel() for p in trainer.ref.parameters()))


def train_steps(num_steps: int) -> list[StepResult]:
    """Advance `num_steps`; returns (on every rank) every run's results for those steps."""
    trainer = _STATE["trainer"]
    return [trainer.advance() for _ in range(num_steps)]


def train_end(_: object = None) -> None:
    _STATE.clear()
