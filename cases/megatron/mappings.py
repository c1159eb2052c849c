"""Megatron-LM / GPT-NeoX `mappings.py`: the tensor- and sequence-parallel collectives.

Stage: step. Each region change is a `torch.autograd.Function` whose forward
and backward are conjugate collectives over the TP group (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2):

    copy_to_tp            forward: identity            backward: all-reduce
    reduce_from_tp        forward: all-reduce          backward: identity
    gather_from_sp        forward: all-gather on seq   backward: reduce-scatter on seq
    reduce_scatter_to_sp  forward: reduce-scatter      backward: all-gather on seq
    scatter_to_sp         forward: split on seq        backward: all-gather on seq
    gather_to_whole       forward: all-gather on dim   backward: split on dim

Every sequence mapping takes the sequence `dim` of the activation layout (1 for [b, s, h],
0 for [s, b, h]), the per-TP-rank `sizes` along it (uneven allowed, zeros allowed; the harness
convention is torch.chunk's, explicit sizes come from `RankContext.seq_shards`) and the `group`.

gloo's all_gather rejects uneven pieces and there is no uneven reduce-scatter anywhere, so the
primitives below pad every rank's piece to max(sizes), run the single-tensor collective on a
buffer whose dim 0 is the sequence dim (moved there first: all_gather_single concatenates along
dim 0 of the contiguous buffer, which for [b, s, h] is the batch dim, GPT-NeoX PR #1260), then
narrow the padding away. With a group of one rank every mapping is the identity and issues no
collective (as Megatron does). Tensors stay on their own device; nothing here assumes CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# torch >= 2.9 renamed the single-tensor collectives; the old names warn.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def _check_sizes(x: torch.Tensor, dim: int, sizes: Sequence[int], group, full: bool) -> None:
    tp = group_size(group)
    if len(sizes) != tp:
        raise ValueError(f"{len(sizes)} shard sizes {list(sizes)} for a group of {tp} ranks")
    want = sum(sizes) if full else sizes[group_rank(group)]
    if x.shape[dim] != want:
        what = "full sequence" if full else f"shard of rank {group_rank(group)}"
        raise ValueError(
            f"expected the {what} ({want} along dim {dim}, sizes {list(sizes)}), "
            f"got shape {tuple(x.shape)}"
        )


# ------------------------------------------------------------------ primitives (no autograd)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group (out of place)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def split_seq(x: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """This rank's piece of a full-sequence tensor (no communication)."""
    if group_size(group) == 1:
        return x
    _check_sizes(x, dim, sizes, group, full=True)
    start = sum(sizes[: group_rank(group)])
    return x.narrow(dim, start, sizes[group_rank(group)]).contiguous()


def all_gather_seq(x: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """Concatenate every rank's piece along `dim` in group-rank order; pieces may be uneven."""
    tp = group_size(group)
    if tp == 1:
        return x
    _check_sizes(x, dim, sizes, group, full=False)
    m = max(sizes)
    piece = x.movedim(dim, 0)  # seq first, so dim 0 of the contiguous buffer is the sequence
    if piece.shape[0] < m:
        pad = piece.new_zeros((m - piece.shape[0],) + tuple(piece.shape[1:]))
        piece = torch.cat([piece, pad], dim=0)
    piece = piece.contiguous()
    out = piece.new_empty((tp * m,) + tuple(piece.shape[1:]))
    _all_gather_single(out, piece, group=group)
    full = torch.cat([out.narrow(0, r * m, n) for r, n in enumerate(sizes)], dim=0)
    return full.movedim(0, dim).contiguous()


def padded_for_reduce_scatter(x: torch.Tensor, dim: int, sizes, tp: int):
    """(input, output) buffers for an uneven reduce-scatter on `dim`: each rank's piece moved to
    dim 0 and padded to the largest piece, so one equal-size collective serves uneven shards."""
    m = max(sizes)
    full = x.movedim(dim, 0)
    buf = full.new_zeros((tp * m,) + tuple(full.shape[1:]))
    start = 0
    for r, n in enumerate(sizes):
        buf.narrow(0, r * m, n).copy_(full.narrow(0, start, n))
        start += n
    return buf, buf.new_empty((m,) + tuple(buf.shape[1:]))


def reduce_scatter_seq(x: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """Sum a full-sequence tensor over the group and keep this rank's piece along `dim`."""
    tp = group_size(group)
    if tp == 1:
        return x
    _check_sizes(x, dim, sizes, group, full=True)
    buf, out = padded_for_reduce_scatter(x, dim, sizes, tp)
    _reduce_scatter_single(out, buf, group=group)
    return out.narrow(0, 0, sizes[group_rank(group)]).movedim(0, dim).contiguous()


# ------------------------------------------------------------------ autograd mappings


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce over the TP group.

    Entering a column-parallel region with a replicated input (TP without SP)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce over the TP group; backward: identity.

    Leaving a row-parallel region to a replicated output (TP without SP)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# Uniform call signatures, so an `Impl` can swap any of them for a broken one:
#   tp mappings:  f(x, group)              seq mappings:  f(x, dim, sizes, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """forward: identity; backward: all-reduce."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-reduce; backward: identity."""
    return _ReduceFromTP.apply(x, group)


def seq_mapping(name: str, forward, backward, doc: str):
    """A sequence mapping (an autograd Function applied as `f(x, dim, sizes, group)`) from two
    primitives `f(x, dim, sizes, group)`, the forward's and the backward's: the three SP mappings
    below, and variants (mutants) that pair a forward with another backward than its conjugate."""

    def fwd(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, tuple(sizes), group
        return forward(x, dim, sizes, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.dim, ctx.sizes, ctx.group), None, None, None

    fn = type(name, (torch.autograd.Function,), {
        "__doc__": doc, "forward": staticmethod(fwd), "backward": staticmethod(bwd),
    })

    def apply(x, dim, sizes, group):
        return fn.apply(x, dim, tuple(sizes), group)

    apply.__doc__ = doc
    apply.__name__ = name
    return apply


gather_from_sp = seq_mapping(
    "GatherFromSP", all_gather_seq, reduce_scatter_seq,
    """forward: all-gather on the seq dim; backward: reduce-scatter on the seq dim.

    Entering a column-parallel region from sequence shards (SP): the region's consumers are
    tensor-parallel, so every rank's grad of the full sequence is a partial sum.""")
reduce_scatter_to_sp = seq_mapping(
    "ReduceScatterToSP", reduce_scatter_seq, all_gather_seq,
    """forward: reduce-scatter on the seq dim; backward: all-gather on the seq dim.

    Leaving a row-parallel region to sequence shards (SP).""")
scatter_to_sp = seq_mapping(
    "ScatterToSP", split_seq, all_gather_seq,
    """forward: split on the seq dim (keep this rank's piece); backward: all-gather on seq.

    From a replicated full sequence to sequence shards (Megatron's embedding output).""")
gather_to_whole = seq_mapping(
    "GatherToWhole", all_gather_seq, split_seq,
    """forward: all-gather on `dim`; backward: split on `dim` (keep this rank's piece).

    Megatron's gather_from_tensor_model_parallel_region: leaving a column-parallel region to a
    consumer every rank runs whole and alike (a loss on the whole vocabulary), so each rank's grad
    of the whole is already the full grad and its piece is all it sends back.""")
