"""Stage: step. Rank side: cutting one step's global batch into this rank's pieces, calling the
sharded model on them, and its share of the loss."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness.config import shards as sh
from sp_harness.config.case import Batch, Case, Layout, Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.step.context import is_dtensor

BATCH_SEED_OFFSET = 7919
"""A check's batches are drawn from its seed plus this prime: a stream of their own among those
seeded from the same config seed (the references' and adversaries' use small offsets)."""


def batch_generator(seed: int) -> torch.Generator:
    """The generator a check's (or a benchmark's) step batches come from, for `seed`."""
    return torch.Generator().manual_seed(seed + BATCH_SEED_OFFSET)


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
    if layout.split_dim is not None:
        dim = _split_dim(layout, tensor.dim())
        sizes = layout.split_sizes or sh.chunk_sizes(tensor.shape[dim], ctx.tp)
        if len(sizes) != ctx.tp or sum(sizes) != tensor.shape[dim]:
            raise ValueError(f"Layout.split_sizes {list(sizes)} must give each of the {ctx.tp} TP ranks its "
                             f"size along dim {layout.split_dim} (summing to {tensor.shape[dim]})")
        offset[dim] = sh.offsets(sizes)[ctx.tp_rank]
        tensor = sh.shard(tensor, dim, sizes, ctx.tp_rank)
    return tensor, tuple(offset)


def _split_dim(layout: Layout, ndim: int) -> int:
    assert layout.split_dim is not None, "cut asks only for a layout with a split_dim"
    dim = layout.split_dim % ndim if -ndim <= layout.split_dim < ndim else None
    taken = {d % ndim for d in (layout.seq_dim, layout.batch_dim) if d is not None and -ndim <= d < ndim}
    if dim is None or dim in taken:
        raise ValueError(f"Layout.split_dim {layout.split_dim} must be a dim of the {ndim}-d tensor other than "
                         f"its seq_dim ({layout.seq_dim}) and batch_dim ({layout.batch_dim})")
    return dim


def target_layout(layout: Layout) -> Layout:
    """The target's layout for an output `layout`: labels have no split (vocab) dim."""
    return dataclasses.replace(layout, split_dim=None, split_sizes=None) if layout.split_dim is not None else layout


def replica_slice(tensor: torch.Tensor, layout: Layout, ctx: RankContext) -> torch.Tensor:
    """The DP replica's part of a global tensor (no sequence cut)."""
    if layout.batch_dim is not None and ctx.dp > 1:
        sizes = sh.chunk_sizes(tensor.shape[layout.batch_dim], ctx.dp)
        return sh.shard(tensor, layout.batch_dim, sizes, ctx.dp_rank)
    return tensor


def input_layout(sharded: Sharded, name: str) -> Layout:
    return sharded.input_layouts.get(name, sharded.input_layout)


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """`batch` with its tensors on `device` (non-tensor inputs as they are)."""
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.inputs.items()}
    return Batch(inputs=inputs, target=batch.target.to(device), positional=batch.positional)


def call(module: nn.Module, inputs: dict[str, Any], positional: bool):
    return module(*inputs.values()) if positional else module(**inputs)


@dataclass(kw_only=True)
class RankBatch:
    """This rank's pieces of one step's batch."""

    inputs: dict[str, Any]
    """Input pieces in the run dtype; floating ones are grad leaves (their grads are judged).
    Non-tensor inputs are here unchanged."""
    offsets: dict[str, tuple[int, ...]]
    """Each input piece's offset in the global input."""
    target: torch.Tensor
    """This rank's piece of the target (cut like the output)."""
    positional: bool
    call_inputs: dict[str, Any]
    """What the sharded module is called with: `inputs` after `Sharded.prepare_inputs`."""


def rank_batch(batch: Batch, sharded: Sharded, ctx: RankContext, dtype: torch.dtype) -> RankBatch:
    inputs: dict[str, Any] = {}
    offsets: dict[str, tuple[int, ...]] = {}
    for name, value in batch.inputs.items():
        if not isinstance(value, torch.Tensor):  # a mask spec, a callable: passed as it is
            inputs[name], offsets[name] = value, ()
            continue
        local, offsets[name] = cut(value, input_layout(sharded, name), ctx)
        if local.is_floating_point():
            local = local.to(dtype).detach().clone().requires_grad_(True)
        inputs[name] = local
    call_inputs = dict(inputs)
    if sharded.prepare_inputs is not None:
        call_inputs = dict(sharded.prepare_inputs(call_inputs, ctx))
    local_tgt, _ = cut(batch.target, target_layout(sharded.output_layout), ctx)
    if local_tgt.is_floating_point():
        # a float64 target would promote the loss of a low-precision run to float64
        local_tgt = local_tgt.to(dtype)
    return RankBatch(inputs=inputs, offsets=offsets, target=local_tgt, positional=batch.positional,
                     call_inputs=call_inputs)


def local_output(out, layout: Layout):
    """This rank's piece of the sharded model's output as `layout` describes it. A DTensor is first
    redistributed on its TP mesh dim to what the layout says, Shard(split_dim), Shard(seq_dim)
    when the sequence is sharded, else Replicate, so that its local tensor is that piece: a
    column-parallel head's Shard(-1) output is gathered (exact), a Partial one summed (the
    model's own reduction), where `to_local()` alone would hand over a shard or a partial sum."""
    if not is_dtensor(out):
        return out
    from torch.distributed.tensor import Replicate, Shard

    want: Shard | Replicate
    if layout.split_dim is not None:
        want = Shard(layout.split_dim % out.ndim)
    elif layout.seq_sharded and layout.seq_dim is not None:
        want = Shard(layout.seq_dim % out.ndim)
    else:
        want = Replicate()
    mesh = out.device_mesh
    names = mesh.mesh_dim_names or ()
    placements = [want if mesh.ndim == 1 or names[i] == "tp" else p for i, p in enumerate(out.placements)]
    if list(out.placements) != placements:
        out = out.redistribute(mesh, placements)
    return out.to_local()


def forward_loss(case: Case, sharded: Sharded, local: RankBatch, target: torch.Tensor,
                 ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded model's local output and this rank's share of the loss: the case's own
    `local_loss`, else the token-loss sum over local tokens / tokens per DP replica."""
    out = local_output(call(sharded.module, local.call_inputs, local.positional), sharded.output_layout)
    if sharded.local_loss is not None:
        # the output as the model made it: a loss may consume its input in place (megatron-core's
        # vocab-parallel cross entropy turns float32 logits into their softmax)
        made = out.detach().clone()
        return made, sharded.local_loss(out, local.target, ctx)
    if sharded.output_layout.split_dim is not None:
        raise ValueError(f"case {case.name}: its output is split on dim {sharded.output_layout.split_dim} "
                         f"(Layout.split_dim), where the case's loss_sum means nothing; give Sharded.local_loss "
                         f"(a vocab-parallel cross entropy returns the whole loss on every TP rank)")
    return out, case.loss_sum(out, local.target) / case.tokens(replica_slice(target, sharded.output_layout, ctx))


def global_loss(loss: torch.Tensor, sharded: Sharded, ctx: RankContext) -> torch.Tensor:
    """The loss of the whole global batch from each rank's share (a collective, float64)."""
    total = loss.detach().to(torch.float64).clone()
    # an output split on another dim (vocab-parallel) leaves every TP rank the whole loss
    if sharded.output_layout.seq_sharded and sharded.output_layout.split_dim is None and ctx.tp > 1:
        dist.all_reduce(total, group=ctx.tp_group)
    if ctx.dp > 1:
        dist.all_reduce(total, group=ctx.dp_group)
        total /= ctx.dp
    return total
