"""The built-in cases' own training steps, written the way Megatron-LM and torchtitan write
theirs, and the switches that turn each into one of the training-step bugs of 2024-2026.

Stage: step. `FrameworkStep` is a `TrainStep` (sp_harness.config.step_protocol): over K
micro-batches each rank sums its tokens' losses and backpropagates the sum over the global
valid-token count (all-reduced over the whole world first: Megatron's `calculate_per_token_loss`
with `num_tokens`, torchtitan's global valid tokens); after the last micro-batch the grads of
params replicated across the sequence group are summed over it and every grad is summed over DP;
the clip norm counts TP-split params on every rank and replicated params once
(Megatron's `param_is_not_tensor_parallel_duplicate`), squares summed in float32 (float64 for a
float64 run); clipping multiplies by min(1, max_norm / (norm + 1e-6)). `with_train_step` attaches
one to a case's sharded factory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from sp_harness.cases.common import all_reduce_coalesced
from sp_harness.config.case import Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.step_protocol import MicroBatch
from sp_harness.reference.gpt import token_loss_sum
from sp_harness.step.optim_ref import make_optimizer

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s and Megatron's guard in max_norm / (norm + eps)."""


@dataclass(kw_only=True, frozen=True)
class StepBugs:
    """Each field set is one shipped training-step bug (the train_mutants.py beside each
    family's cases names its source); all unset is the correct step."""

    mean_of_means: bool = False
    """Each micro-batch normalised by its own valid tokens, the K means averaged."""
    drop_middle: bool = False
    """Micro-batches 1..K-2 run forward but never reach the accumulated grads."""
    local_count: Literal["", "seq", "dp"] = ""
    """'seq': each rank normalises by its own valid tokens, grads then averaged over the sequence
    group; 'dp': each DP replica by its own, grads averaged over DP."""
    clip_skips: str = ""
    """A local param name the clip norm leaves out."""
    norm_avg_shards: bool = False
    """The clip norm's squares averaged over TP instead of summed."""
    loss_times_sp: bool = False
    """Each rank's loss (and so every grad) multiplied by the sequence-parallel degree."""
    skip_sp_sync_with_dp: bool = False
    """With dp > 1, the grads of params replicated across the sequence group are never summed over it."""
    ga_times_sp: bool = False
    """The accumulation divisor multiplied by the sequence-parallel degree (grads / sp)."""
    logged_loss_per_rank: bool = False
    """The reported loss is the mean of each rank's own mean, not the token mean."""


def _sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


class FrameworkStep:
    """A framework-style training step over one rank's sharded model."""

    def __init__(self, module: nn.Module, ctx: RankContext, *, tp_split: set[str], seq_summed: set[str],
                 bugs: StepBugs = StepBugs()):
        """`tp_split`: local names of the params split across the TP group; `seq_summed`: those
        whose grads each sequence shard holds a part of (replicated params a sequence-sharded
        forward reaches), summed over the TP/CP group after backward."""
        config = ctx.config
        assert config.optimizer is not None and config.lr is not None, "the check resolves optimizer and lr"
        self.module, self.ctx, self.bugs = module, ctx, bugs
        self.named = dict(module.named_parameters())
        self.tp_split, self.seq_summed = tp_split, seq_summed
        self.optimizer = make_optimizer(config.optimizer, config.lr, self.named.values())
        self.clip = config.clip_grad_norm
        dtype = next(iter(self.named.values())).dtype
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        ctx, bugs = self.ctx, self.bugs
        k_total = len(micro_batches)
        counts = torch.stack([mb.valid.sum() for mb in micro_batches]).to(torch.float64)
        local = counts.sum()
        divisor = self._divisor(local)
        mb_global = _sum(counts.clone()) if bugs.mean_of_means else None
        sums = []
        for k, mb in enumerate(micro_batches):
            out = mb.call(self.module)
            loss_sum = token_loss_sum(out, mb.target)
            sums.append(loss_sum.detach().to(torch.float64))
            if bugs.mean_of_means:
                assert mb_global is not None
                loss = loss_sum / mb_global[k].clamp(min=1) / k_total * ctx.dp
            else:
                loss = loss_sum / divisor
            if bugs.loss_times_sp:
                loss = loss * ctx.tp
            if bugs.ga_times_sp:
                loss = loss / ctx.tp
            if bugs.drop_middle and 0 < k < k_total - 1:
                continue  # its loss is counted below, its grads are lost
            loss.backward()
        self._finalize()
        return self._reported(torch.stack(sums), counts, mb_global)

    def _divisor(self, local: torch.Tensor) -> torch.Tensor:
        """What every rank divides its token-loss sum by."""
        ctx, bugs = self.ctx, self.bugs
        if bugs.local_count == "seq":
            return local.clamp(min=1)
        if bugs.local_count == "dp":
            return _sum(local.clone(), ctx.tp_group).clamp(min=1)
        return _sum(local.clone()).clamp(min=1)

    def _finalize(self) -> None:
        """The grad sync after the last micro-batch: sequence-group sums, then DP."""
        ctx, bugs = self.ctx, self.bugs
        grads = {}
        for name, p in self.named.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a param this rank's tokens never reached
            grads[name] = p.grad
        summed = [grads[n] for n in sorted(self.seq_summed)]
        if ctx.tp > 1 and not (bugs.skip_sp_sync_with_dp and ctx.dp > 1):
            all_reduce_coalesced(summed, ctx.tp_group, divide_by=ctx.tp if bugs.local_count == "seq" else 1)
        elif ctx.tp > 1 and bugs.local_count == "seq":
            for g in summed:
                g.div_(ctx.tp)
        if ctx.dp > 1:
            every = list(grads.values())
            averaged = bugs.local_count in ("seq", "dp") or bugs.mean_of_means
            all_reduce_coalesced(every, ctx.dp_group, divide_by=ctx.dp if averaged else 1)

    def _reported(self, sums: torch.Tensor, counts: torch.Tensor, mb_global: torch.Tensor | None) -> torch.Tensor:
        ctx, bugs = self.ctx, self.bugs
        if bugs.mean_of_means:
            assert mb_global is not None
            per_mb = _sum(sums.clone()) / mb_global.clamp(min=1)
            reported = per_mb.mean()
        elif bugs.logged_loss_per_rank or bugs.local_count == "seq":
            reported = _sum(sums.sum() / counts.sum().clamp(min=1)) / dist.get_world_size()
        elif bugs.local_count == "dp":
            replica = _sum(sums.sum(), ctx.tp_group) / _sum(counts.sum(), ctx.tp_group).clamp(min=1)
            reported = _sum(replica, ctx.dp_group) / ctx.dp
        else:
            reported = _sum(sums.sum()) / _sum(counts.sum()).clamp(min=1)
        return reported * ctx.tp if bugs.loss_times_sp else reported

    def grad_norm(self) -> torch.Tensor:
        ctx, bugs = self.ctx, self.bugs
        split = torch.zeros((), dtype=self.acc)
        replicated = torch.zeros((), dtype=self.acc)
        for name, p in self.named.items():
            if p.grad is None or name == bugs.clip_skips:
                continue
            sq = p.grad.detach().to(self.acc).pow(2).sum()
            if name in self.tp_split:
                split += sq
            else:
                replicated += sq
        if bugs.norm_avg_shards:
            total = _sum(split + replicated, ctx.tp_group) / ctx.tp
        else:
            # a replicated param is counted on TP rank 0 only
            total = _sum(split + (replicated if ctx.tp_rank == 0 else torch.zeros_like(replicated)), ctx.tp_group)
        return total.sqrt()

    def step(self) -> torch.Tensor:
        norm = self.grad_norm()
        if self.clip is not None:
            coef = torch.clamp(self.clip / (norm + CLIP_EPS), max=1.0)
            for p in self.named.values():
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def with_train_step(shard: Callable[[nn.Module, RankContext], Sharded], seq_summed: Callable[[Sharded], set[str]],
                    bugs: StepBugs = StepBugs()) -> Callable[[nn.Module, RankContext], Sharded]:
    """`shard` with a `FrameworkStep` attached. `seq_summed(sharded)`: the local names of params
    whose grads are summed over the sequence group."""

    def sharded_with_step(ref: nn.Module, ctx: RankContext) -> Sharded:
        sharded = shard(ref, ctx)
        split = {name for name, spec in sharded.params.items() if not spec.replicated_tp}
        step = FrameworkStep(sharded.module, ctx, tp_split=split, seq_summed=seq_summed(sharded), bugs=bugs)
        return dataclasses.replace(sharded, train_step=step)

    return sharded_with_step


def marked_sequence_parallel(sharded: Sharded) -> set[str]:
    """Megatron: the params it marks `sequence_parallel` (norms, biases after a reduce-scatter)."""
    return {n for n, p in sharded.module.named_parameters() if getattr(p, "sequence_parallel", False)}


def every_param(sharded: Sharded) -> set[str]:
    """Context parallelism: every param is replicated and each rank's tokens reach it."""
    return {n for n, _ in sharded.module.named_parameters()}


__all__ = ["CLIP_EPS", "FrameworkStep", "StepBugs", "every_param", "marked_sequence_parallel", "with_train_step"]
