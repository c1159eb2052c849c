"""Broken collectives of the Megatron-style GPT: wrong group, wrong dim, wrong order, sizes that
assume even shards, a backward that splits instead of reducing. Each is `CORRECT` with one
`Impl` piece swapped (sp_harness.cases.megatron.mutants.megatron_mutant)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sp_harness.cases.megatron import mappings as mp
from sp_harness.cases.megatron.mutants import megatron_mutant


def _seq_collectives(name: str, gather, reduce_scatter, how: str) -> dict[str, Any]:
    """`Impl` fields for a broken pair of sequence collectives: the all-gather and the
    reduce-scatter are each other's backward, both broken the same way (`how`)."""
    return dict(
        gather_from_sp=mp.seq_mapping(f"Gather{name}", gather, reduce_scatter,
                                      f"forward: all-gather {how}; backward: reduce-scatter {how}"),
        reduce_scatter_to_sp=mp.seq_mapping(f"ReduceScatter{name}", reduce_scatter, gather,
                                            f"forward: reduce-scatter {how}; backward: all-gather {how}"),
    )


# ----------------------------------------------------------------- collectives


def _reduce_scatter_no_group(x, dim, sizes, group):
    """reduce_scatter_seq with the collective missing `group=`: runs over WORLD."""
    tp = mp.group_size(group)
    if tp == 1:
        return x
    buf, out = mp.padded_for_reduce_scatter(x, dim, sizes, tp)
    mp._reduce_scatter_single(out, buf)  # BUG: no group=
    return out.narrow(0, 0, sizes[mp.group_rank(group)]).movedim(0, dim).contiguous()


RS_WORLD = megatron_mutant(
    "mutant-sp-reduce-scatter-world",
    "sp",
    "reduce-scatter without group= (WORLD)",
    "reduce-scatter called without group=, so it runs over WORLD instead of the TP group: "
    "identical when dp == 1, a size error or wrong sums once dp > 1 (the missing-group= class "
    "of bug, e.g. Megatron-DeepSpeed / GPT-NeoX mpu call sites)",
    reduce_scatter_to_sp=mp.seq_mapping(
        "ReduceScatterNoGroup", _reduce_scatter_no_group, mp.all_gather_seq,
        "forward: reduce-scatter over WORLD (BUG: no group=); backward: all-gather",
    ),
    source="missing group= call sites (Megatron-DeepSpeed / GPT-NeoX mpu)",
    killed_by=("crash", "dp2xtp2"),
)


def _all_reduce_no_group(x):
    out = x.contiguous().clone()
    dist.all_reduce(out)  # BUG: no group=
    return out


class _ReduceFromTPWorld(torch.autograd.Function):
    """forward: all-reduce over WORLD (BUG: no group=); backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return x if mp.group_size(group) == 1 else _all_reduce_no_group(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


TP_ALL_REDUCE_WORLD = megatron_mutant(
    "mutant-tp-all-reduce-world",
    "tp",
    "all-reduce without group= (WORLD)",
    "row-parallel all-reduce without group=: sums the partial products over WORLD, i.e. also "
    "over the DP replicas' different micro-batches; identical when dp == 1",
    reduce_from_tp=lambda x, group: _ReduceFromTPWorld.apply(x, group),
    source="missing group= call sites (Megatron-DeepSpeed / GPT-NeoX mpu)",
    killed_by=("forward", "dp2xtp2"),
)


def _gather_no_movedim(x, dim, sizes, group):
    """all_gather_seq without moving the seq dim first. all_gather_into_tensor writes the rank
    pieces one after another in memory (NCCL only checks numel), i.e. concatenates on dim 0; the
    buffer is then read as if the pieces had been concatenated on `dim`. gloo checks shapes, so
    the collective runs on flat views, which is byte-for-byte what NCCL does."""
    tp = mp.group_size(group)
    if tp == 1:
        return x
    m = max(sizes)
    if x.shape[dim] < m:
        pad_shape = list(x.shape)
        pad_shape[dim] = m - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    x = x.contiguous()
    out_shape = list(x.shape)
    out_shape[dim] = tp * m
    out = x.new_empty(tp * x.numel())
    mp._all_gather_single(out, x.view(-1), group=group)
    out = out.view(out_shape)  # BUG for dim != 0: rank pieces are contiguous blocks of memory
    return torch.cat([out.narrow(dim, r * m, n) for r, n in enumerate(sizes)], dim=dim)


def _reduce_scatter_no_movedim(x, dim, sizes, group):
    """reduce_scatter_seq without moving the seq dim first: the buffer laid out with the rank
    pieces along `dim` is cut into contiguous blocks of memory (dim 0), as NCCL would."""
    tp = mp.group_size(group)
    if tp == 1:
        return x
    m = max(sizes)
    buf_shape = list(x.shape)
    buf_shape[dim] = tp * m
    buf = x.new_zeros(buf_shape)
    start = 0
    for r, n in enumerate(sizes):
        buf.narrow(dim, r * m, n).copy_(x.narrow(dim, start, n))
        start += n
    out_shape = list(x.shape)
    out_shape[dim] = m
    out = x.new_empty(buf.numel() // tp)
    mp._reduce_scatter_single(out, buf.view(-1), group=group)
    out = out.view(out_shape)  # BUG for dim != 0
    return out.narrow(dim, 0, sizes[mp.group_rank(group)]).contiguous()


GATHER_DIM0 = megatron_mutant(
    "mutant-sp-gather-dim0-bsh",
    "sp",
    "seq gather/reduce-scatter on dim 0 of [b, s, h]",
    "seq all-gather and reduce-scatter on dim 0 of a [b, s, h] buffer, the batch not the sequence; "
    "all_gather_into_tensor / reduce_scatter_tensor concatenate and split on dim 0, right for "
    "Megatron's [s, b, h], wrong for GPT-NeoX's [b, s, h] (GPT-NeoX PR #1260 'Fix gather and "
    "reduce scatter ops on sequence dimension'); visible with layout=bsh",
    **_seq_collectives("NoMovedim", _gather_no_movedim, _reduce_scatter_no_movedim, "on dim 0 (BUG for [b, s, h])"),
    source="GPT-NeoX PR #1260 'Fix gather and reduce scatter ops on sequence dimension'",
    killed_by=("forward", "even"),
)


def _gather_assume_even(x, dim, sizes, group):
    """Megatron's _gather_along_first_dim: output size = local size * tp, no padding."""
    tp = mp.group_size(group)
    if tp == 1:
        return x
    piece = x.movedim(dim, 0).contiguous()
    out = piece.new_empty((tp * piece.shape[0],) + tuple(piece.shape[1:]))
    mp._all_gather_single(out, piece, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_assume_even(x, dim, sizes, group):
    """Megatron's _reduce_scatter_along_first_dim: output size = full size // tp."""
    tp = mp.group_size(group)
    if tp == 1:
        return x
    full = x.movedim(dim, 0).contiguous()
    n = full.shape[0] // tp
    out = full.new_empty((n,) + tuple(full.shape[1:]))
    mp._reduce_scatter_single(out, full.narrow(0, 0, n * tp).contiguous(), group=group)
    return out.movedim(0, dim).contiguous()


EVEN_COLLECTIVES = megatron_mutant(
    "mutant-sp-collectives-assume-even",
    "sp",
    "seq collectives assume even shards",
    "sequence all-gather / reduce-scatter sized as local*tp and full//tp (Megatron's "
    "_gather_along_first_dim / _reduce_scatter_along_first_dim, which require seq_len % tp == 0): "
    "identical on even shards; on uneven shards the ranks disagree on the message size (gloo "
    "aborts or the shapes break)",
    **_seq_collectives("AssumeEven", _gather_assume_even, _reduce_scatter_assume_even, "assuming even shards"),
    source="Megatron-LM mappings.py _gather_along_first_dim / _reduce_scatter_along_first_dim (assume seq_len % tp == 0)",
    killed_by=("crash", "uneven"),
)


def _gather_reversed(x, dim, sizes, group):
    """all_gather_seq that lays the pieces out in reverse rank order."""
    tp = mp.group_size(group)
    if tp == 1:
        return x
    pieces = [None] * tp
    full = mp.all_gather_seq(x, dim, sizes, group)
    start = 0
    for r, n in enumerate(sizes):
        pieces[tp - 1 - r] = full.narrow(dim, start, n)
        start += n
    return torch.cat(pieces, dim=dim)


def _reduce_scatter_reversed(x, dim, sizes, group):
    """The adjoint of _gather_reversed: this rank keeps the piece at the reversed position."""
    tp = mp.group_size(group)
    if tp == 1:
        return x
    rev = tuple(reversed(sizes))
    start = 0
    pieces = []
    for n in rev:
        pieces.append(x.narrow(dim, start, n))
        start += n
    return mp.reduce_scatter_seq(torch.cat(pieces[::-1], dim=dim), dim, sizes, group)


GATHER_ORDER = megatron_mutant(
    "mutant-sp-gather-wrong-order",
    "sp",
    "seq all-gather in reversed rank order",
    "sequence all-gather concatenating the shards in the wrong rank order (e.g. ordered by a rank "
    "map that is not the TP group's rank order): attention sees a permuted sequence, so the "
    "causal mask and positions no longer line up",
    gather_from_sp=mp.seq_mapping(
        "GatherWrongOrder", _gather_reversed, _reduce_scatter_reversed,
        "forward: all-gather in reversed rank order; backward: its adjoint reduce-scatter",
    ),
    source="the rank-map class of hybrid meshes: a gather ordered by global rank, not the TP group's order",
    killed_by=("forward", "even"),
)

GATHER_SPLIT_BACKWARD = megatron_mutant(
    "mutant-sp-gather-backward-split",
    "sp",
    "seq all-gather backward splits, no reduce-scatter",
    "backward of the sequence all-gather that splits instead of reduce-scattering: Megatron's "
    "gather_from_sequence_parallel_region(tensor_parallel_output_grad=False) used in front of a "
    "tensor-parallel consumer, which drops the other ranks' partial grads (see the flag's use in "
    "Megatron-LM mappings.py and awslabs/slapo PR #20)",
    gather_from_sp=mp.seq_mapping(
        "GatherSplitBackward", mp.all_gather_seq, mp.split_seq,
        "forward: all-gather on seq dim; backward: split (BUG: no reduce-scatter)",
    ),
    source="Megatron-LM mappings.py gather_from_sequence_parallel_region(tensor_parallel_output_grad=False); awslabs/slapo PR #20",
    killed_by=("grad", "even"),
)


