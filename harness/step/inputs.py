"""Stage: step (rank side). Cutting one step's global batch into this rank's pieces, calling the
sharded model on them, and its share of the loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sp_harness.config import shards as sh
from sp_harness.config.case import Batch, Case, Layout, RankContext, Sharded
from sp_harness.step.context import is_dtensor


def seq_index(layout: Layout, seq_len: int, seq_shards: tuple[int, ...], tp_rank: int) -> torch.Tensor | None:
    """The global positions a TP rank's piece holds, in its order, for a permuted layout; else None."""
    if layout.seq_order is None or not layout.seq_sharded:
        return None
    order = torch.as_tensor(layout.seq_order(seq_len, tuple(seq_shards)), dtype=torch.long)
    if sorted(order.tolist()) != list(range(seq_len)):
        raise ValueError(f"Layout.seq_order({seq_len}, {list(seq_shards)}) is not a permutation of "
                         f"0..{seq_len - 1}: {order.tolist()}")
    return order.narrow(0, sh.offsets(seq_shards)[tp_rank], seq_shards[tp_rank])


def cut(tensor: torch.Tensor, layout: Layout, ctx: RankContext) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's piece of a global tensor, and the piece's offset in it (0 on a permuted
    sequence dim: the piece's rows are `seq_index`'s positions, not one range)."""
    offset = [0] * tensor.dim()
    if layout.batch_dim is not None and ctx.dp > 1:
        sizes = sh.chunk_sizes(tensor.shape[layout.batch_dim], ctx.dp)
        offset[layout.batch_dim] = sh.offsets(sizes)[ctx.dp_rank]
        tensor = sh.shard(tensor, layout.batch_dim, sizes, ctx.dp_rank)
    if layout.seq_dim is not None and layout.seq_sharded:
        index = seq_index(layout, tensor.shape[layout.seq_dim], ctx.seq_shards, ctx.tp_rank)
        if index is None:
            offset[layout.seq_dim] = sh.offsets(ctx.seq_shards)[ctx.tp_rank]
            tensor = sh.shard(tensor, layout.seq_dim, ctx.seq_shards, ctx.tp_rank)
        else:
            tensor = tensor.index_select(layout.seq_dim, index.to(tensor.device))
    return tensor, tuple(offset)


def replica_slice(tensor: torch.Tensor, layout: Layout, ctx: RankContext) -> torch.Tensor:
    """The DP replica's part of a global tensor (no sequence cut)."""
    if layout.batch_dim is not None and ctx.dp > 1:
        sizes = sh.chunk_sizes(tensor.shape[layout.batch_dim], ctx.dp)
        return sh.shard(tensor, layout.batch_dim, sizes, ctx.dp_rank)
    return tensor


def input_layout(sharded: Sharded, name: str) -> Layout:
    return sharded.input_layouts.get(name, sharded.input_layout)


def call(module: nn.Module, inputs: dict[str, torch.Tensor], positional: bool):
    return module(*inputs.values()) if positional else module(**inputs)


@dataclass(kw_only=True)
class RankBatch:
    """This rank's pieces of one step's batch."""

    inputs: dict[str, torch.Tensor]
    """Input pieces in the run dtype; floating ones are grad leaves (their grads are judged)."""
    offsets: dict[str, tuple[int, ...]]
    """Each input piece's offset in the global input."""
    target: torch.Tensor
    """This rank's piece of the target (cut like the output)."""
    positional: bool


def rank_batch(batch: Batch, sharded: Sharded, ctx: RankContext, dtype: torch.dtype) -> RankBatch:
    inputs, offsets = {}, {}
    for name, tensor in batch.inputs.items():
        local, offsets[name] = cut(tensor, input_layout(sharded, name), ctx)
        if local.is_floating_point():
            local = local.to(dtype).detach().clone().requires_grad_(True)
        inputs[name] = local
    local_tgt, _ = cut(batch.target, sharded.output_layout, ctx)
    if local_tgt.is_floating_point():
        # a float64 target would promote the loss of a low-precision run to float64
        local_tgt = local_tgt.to(dtype)
    return RankBatch(inputs=inputs, offsets=offsets, target=local_tgt, positional=batch.positional)


def forward_loss(case: Case, sharded: Sharded, local: RankBatch, target: torch.Tensor,
                 ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded model's local output and this rank's share of the loss: the case's own
    `local_loss`, else the token-loss sum over local tokens / tokens per DP replica."""
    out = call(sharded.module, local.inputs, local.positional)
    if is_dtensor(out):
        out = out.to_local()
    if sharded.local_loss is not None:
        return out, sharded.local_loss(out, local.target, ctx)
    return out, case.loss_sum(out, local.target) / case.tokens(replica_slice(target, sharded.output_layout, ctx))


def global_loss(loss: torch.Tensor, sharded: Sharded, ctx: RankContext) -> torch.Tensor:
    """The loss of the whole global batch from each rank's share (a collective, float64)."""
    total = loss.detach().to(torch.float64).clone()
    if sharded.output_layout.seq_sharded and ctx.tp > 1:
        dist.all_reduce(total, group=ctx.tp_group)
    if ctx.dp > 1:
        dist.all_reduce(total, group=ctx.dp_group)
        total /= ctx.dp
    return total
