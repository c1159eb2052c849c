"""The swappable pieces of the Megatron-style GPT, gathered in one frozen `Impl`.

Stage: step. The model in `model.py` calls every collective, the row-parallel bias
rule, the position ids, the grad sync and the loss through an `Impl`, so a broken variant
(a mutant in cases/megatron/mutants.py) is one field swapped:

    BROKEN = dataclasses.replace(CORRECT, gather_from_sp=my_broken_gather)

and a case built from it with `cases.megatron.cases.megatron_case(name, "sp", BROKEN, ...)`.
Field signatures:

    copy_to_tp(x, group), reduce_from_tp(x, group)                     TP region mappings
    gather_from_sp(x, dim, sizes, group), reduce_scatter_to_sp(...)    SP region mappings
    row_parallel(x, weight, bias, reduce) -> y                         row-parallel linear
    sequence_parallel_kinds                                            params marked under SP
    sp_grad_group(ctx) -> group                                        group their grads sum over
    sync_grads(module, ctx, impl, sequence_parallel)                   after backward
    positions(n_local, seq_sizes, shard_index, device) -> int64 ids    position ids of a shard
    seq_dim(layout) -> int                                             seq dim of activations
    local_loss(local_out, local_target, ctx) or None                   None: engine default
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from sp_harness.cases.common import all_reduce_coalesced
from sp_harness.cases.megatron import mappings

SP_KINDS = frozenset({"norm", "row_bias", "embedding", "lm_head"})
"""Parameters applied on sequence shards under SP, whose grads are partial sums over TP:
norm weights/biases, row-parallel biases (added after the reduce-scatter), the token and
position embeddings (tokens arrive sequence-sharded) and the replicated LM head."""


def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias, reduce) -> torch.Tensor:
    """Row-parallel linear: partial products reduced over TP, the bias added once after."""
    y = reduce(F.linear(x, weight))
    return y if bias is None else y + bias


def global_positions(n_local: int, seq_sizes: Sequence[int], shard_index: int, device) -> torch.Tensor:
    """Position ids of this rank's tokens: the shard's GLOBAL offset plus 0..n_local-1."""
    start = sum(seq_sizes[:shard_index])
    return torch.arange(start, start + n_local, device=device)


def seq_dim(layout: str) -> int:
    """Sequence dim of the internal activations: [b, s, h] -> 1, [s, b, h] -> 0."""
    return {"bsh": 1, "sbh": 0}[layout]


def tp_group(ctx) -> dist.ProcessGroup:
    return ctx.tp_group


def sync_grads(module: nn.Module, ctx, impl: "Impl", sequence_parallel: bool) -> None:
    """After backward: under SP, sum the grads of params marked `sequence_parallel` over the TP
    group (Megatron's allreduce_layernorm_grads); then with dp > 1 average every grad over DP."""
    if sequence_parallel and ctx.tp > 1:
        marked = [
            p.grad for p in module.parameters()
            if getattr(p, "sequence_parallel", False) and p.grad is not None
        ]
        all_reduce_coalesced(marked, impl.sp_grad_group(ctx))
    if ctx.dp > 1:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        all_reduce_coalesced(grads, ctx.dp_group, divide_by=ctx.dp)


@dataclass(frozen=True)
class Impl:
    """Every piece of the implementation a bug could live in. `CORRECT` is the right one."""

    copy_to_tp: Callable = mappings.copy_to_tp
    reduce_from_tp: Callable = mappings.reduce_from_tp
    gather_from_sp: Callable = mappings.gather_from_sp
    reduce_scatter_to_sp: Callable = mappings.reduce_scatter_to_sp
    row_parallel: Callable = row_parallel
    sequence_parallel_kinds: frozenset = SP_KINDS
    sp_grad_group: Callable = tp_group
    sync_grads: Callable = sync_grads
    positions: Callable = global_positions
    seq_dim: Callable = seq_dim
    local_loss: Callable | None = None


CORRECT = Impl()
