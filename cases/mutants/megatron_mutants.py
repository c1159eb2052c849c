"""Broken variants of the Megatron-style GPT: each is `CORRECT` with one `Impl` piece swapped.

Stage: build sharded. Every mutant is a registered Case tagged "mutant" whose `models_bug` names
the real bug it models. Which configs expose each one is in the docstring next to it; the
default suite must kill all of them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.nn import functional as F

from sp_harness.cases.megatron import mappings as mp
from sp_harness.cases.megatron.cases import SP, TP, megatron_shard
from sp_harness.cases.megatron.impl import CORRECT, SP_KINDS, sync_grads
from sp_harness.config.case import mutant
from sp_harness.reference.gpt import token_loss_sum

TAGS = ("mutant", "megatron")


def _mutant(name: str, mode: str, short: str, bug: str, *, source: str, **swap):
    """`CORRECT` with the `Impl` fields in `swap` replaced, as a mutant of the TP or SP case."""
    impl = dataclasses.replace(CORRECT, **swap)
    base = SP if mode == "sp" else TP
    return mutant(base, name=name, summary=short, bug=bug, source=source,
                  shard=megatron_shard(impl, sequence_parallel=mode == "sp"))


# ----------------------------------------------------------------- grad sync of SP params
# Visible at tp > 1 under SP (any seq split): the replicated params drift apart across TP.

NO_NORM_SYNC = _mutant(
    "mutant-sp-no-norm-grad-sync",
    "sp",
    "norm grads not summed over TP",
    "norm weight/bias grads not all-reduced over TP under SP: each rank's norm sees only its "
    "sequence shard, so its grad is a partial sum (GPT-NeoX PR #1257 shipped Megatron-style SP "
    "without the sync, fixed in PR #1259 'Fix LayerNorm all reduce gradient hook'; Megatron's "
    "allreduce_layernorm_grads, see NVIDIA/Megatron-LM#443, NVIDIA/TransformerEngine#435)",
    sequence_parallel_kinds=SP_KINDS - {"norm"},
    source="GPT-NeoX PR #1257 / #1259; NVIDIA/Megatron-LM#443; NVIDIA/TransformerEngine#435",
)

def _sync_grads_rebuilt_bucket(module, ctx, impl, sequence_parallel):
    """Correct for two iterations; from the third call on the norm grads are left out of the
    TP sync, as when a grad bucket rebuilt after the first iterations omits them."""
    calls = getattr(module, "_sync_calls", 0)
    module._sync_calls = calls + 1
    if calls < 2:
        return sync_grads(module, ctx, impl, sequence_parallel)
    dropped = [p for n, p in module.named_parameters() if "norm" in n]
    saved = [p.sequence_parallel for p in dropped]
    for p in dropped:
        p.sequence_parallel = False
    try:
        sync_grads(module, ctx, impl, sequence_parallel)
    finally:
        for p, flag in zip(dropped, saved, strict=True):
            p.sequence_parallel = flag


NORM_SYNC_LOST_AT_STEP_3 = _mutant(
    "mutant-sp-norm-sync-lost-at-step-3",
    "sp",
    "norm grads dropped from the TP sync from the third step on",
    "norm grads dropped from the SP grad sync from the third iteration on: PyTorch DDP rebuilds "
    "its grad buckets after the first iteration (Reducer::rebuild_buckets), and grad-sync "
    "schemes that rebuild or re-register hooks later can leave params out of the new bucket; "
    "a check of only two steps never sees it (GPT-NeoX #1257's unsynced norms, appearing late)",
    sync_grads=_sync_grads_rebuilt_bucket,
    source="PyTorch DDP Reducer::rebuild_buckets; GPT-NeoX #1257's unsynced norms",
)


NORM_SYNC_DP = _mutant(
    "mutant-sp-norm-grad-sync-dp-group",
    "sp",
    "SP grads summed over DP instead of TP",
    "SP grads of norms and other shard-applied params summed over the DP group instead of TP; "
    "the right collective on the wrong process group (the group= mix-up class; GPT-NeoX PR #1259 "
    "also had to fix that hook, which averaged instead of summing)",
    sp_grad_group=lambda ctx: ctx.dp_group,
    source="GPT-NeoX PR #1259 (the hook's group and reduction)",
)

NO_ROW_BIAS_SYNC = _mutant(
    "mutant-sp-no-row-bias-grad-sync",
    "sp",
    "row-parallel bias grads not summed over TP",
    "row-parallel bias grads not all-reduced over TP under SP; the bias of out_proj and fc2 is "
    "added after the reduce-scatter, on each rank's shard, so its grad is partial (Megatron marks "
    "it `sequence_parallel` in RowParallelLinear for this reason)",
    sequence_parallel_kinds=SP_KINDS - {"row_bias"},
    source="Megatron-LM RowParallelLinear marks its bias `sequence_parallel` for this sync",
)

NO_EMBEDDING_SYNC = _mutant(
    "mutant-sp-no-embedding-grad-sync",
    "sp",
    "embedding grads not summed over TP",
    "token/position embedding grads not all-reduced over TP when the tokens arrive "
    "sequence-sharded: Megatron embeds the full sequence then scatters, so porting its sync list "
    "to an embed-the-shard model forgets the embeddings",
    sequence_parallel_kinds=SP_KINDS - {"embedding"},
    source="Megatron-LM embeds the full sequence, then scatters: its sync list has no embedding entry for SP",
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


RS_WORLD = _mutant(
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


TP_ALL_REDUCE_WORLD = _mutant(
    "mutant-tp-all-reduce-world",
    "tp",
    "all-reduce without group= (WORLD)",
    "row-parallel all-reduce without group=: sums the partial products over WORLD, i.e. also "
    "over the DP replicas' different micro-batches; identical when dp == 1",
    reduce_from_tp=lambda x, group: _ReduceFromTPWorld.apply(x, group),
    source="missing group= call sites (Megatron-DeepSpeed / GPT-NeoX mpu)",
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


GATHER_DIM0 = _mutant(
    "mutant-sp-gather-dim0-bsh",
    "sp",
    "seq gather/reduce-scatter on dim 0 of [b, s, h]",
    "seq all-gather and reduce-scatter on dim 0 of a [b, s, h] buffer, the batch not the sequence; "
    "all_gather_into_tensor / reduce_scatter_tensor concatenate and split on dim 0, right for "
    "Megatron's [s, b, h], wrong for GPT-NeoX's [b, s, h] (GPT-NeoX PR #1260 'Fix gather and "
    "reduce scatter ops on sequence dimension'); visible with layout=bsh",
    gather_from_sp=mp.seq_mapping(
        "GatherNoMovedim", _gather_no_movedim, _reduce_scatter_no_movedim,
        "forward: all-gather on dim 0 (BUG for [b, s, h]); backward: reduce-scatter on dim 0",
    ),
    reduce_scatter_to_sp=mp.seq_mapping(
        "ReduceScatterNoMovedim", _reduce_scatter_no_movedim, _gather_no_movedim,
        "forward: reduce-scatter on dim 0 (BUG for [b, s, h]); backward: all-gather on dim 0",
    ),
    source="GPT-NeoX PR #1260 'Fix gather and reduce scatter ops on sequence dimension'",
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


EVEN_COLLECTIVES = _mutant(
    "mutant-sp-collectives-assume-even",
    "sp",
    "seq collectives assume even shards",
    "sequence all-gather / reduce-scatter sized as local*tp and full//tp (Megatron's "
    "_gather_along_first_dim / _reduce_scatter_along_first_dim, which require seq_len % tp == 0): "
    "identical on even shards; on uneven shards the ranks disagree on the message size (gloo "
    "aborts or the shapes break)",
    gather_from_sp=mp.seq_mapping(
        "GatherAssumeEven", _gather_assume_even, _reduce_scatter_assume_even,
        "forward: all-gather assuming even shards; backward: reduce-scatter assuming even shards",
    ),
    reduce_scatter_to_sp=mp.seq_mapping(
        "ReduceScatterAssumeEven", _reduce_scatter_assume_even, _gather_assume_even,
        "forward: reduce-scatter assuming even shards; backward: all-gather assuming even shards",
    ),
    source="Megatron-LM mappings.py _gather_along_first_dim / _reduce_scatter_along_first_dim (assume seq_len % tp == 0)",
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


GATHER_ORDER = _mutant(
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
)

GATHER_SPLIT_BACKWARD = _mutant(
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
)


# ----------------------------------------------------------------- row-parallel bias


def _bias_before_reduce(x, weight, bias, reduce):
    return reduce(F.linear(x, weight, bias))  # BUG: every rank adds the bias, then the sum


ROW_BIAS_BEFORE = _mutant(
    "mutant-sp-row-bias-before-reduce",
    "sp",
    "row-parallel bias added before reduce-scatter",
    "row-parallel bias added on every rank before the reduce-scatter, so the output carries "
    "tp x bias (Megatron's RowParallelLinear adds the bias after the reduction for this reason)",
    row_parallel=_bias_before_reduce,
    source="Megatron-LM RowParallelLinear adds the bias after the reduction",
)

TP_ROW_BIAS_BEFORE = _mutant(
    "mutant-tp-row-bias-before-reduce",
    "tp",
    "row-parallel bias added before all-reduce",
    "row-parallel bias added on every rank before the all-reduce, so the output carries "
    "tp x bias (Megatron's RowParallelLinear adds the bias after the reduction for this reason)",
    row_parallel=_bias_before_reduce,
    source="Megatron-LM RowParallelLinear adds the bias after the reduction",
)


# ----------------------------------------------------------------- positions and loss


def _local_positions(n_local, seq_sizes, shard_index, device):
    return torch.arange(n_local, device=device)  # BUG: every shard starts at position 0


LOCAL_POSITIONS = _mutant(
    "mutant-sp-local-positions",
    "sp",
    "position ids local, not global",
    "position ids from the local shard (0..n_local-1) instead of the shard's global offset: every "
    "rank but the first embeds the wrong positions (the position_ids-not-offset bug class of "
    "sequence/context-parallel ports)",
    positions=_local_positions,
    source="the position_ids-not-offset class of sequence/context-parallel ports",
)


def _even_offset_positions(n_local, seq_sizes, shard_index, device):
    start = shard_index * n_local  # BUG: assumes every shard has n_local tokens
    return torch.arange(start, start + n_local, device=device)


EVEN_POSITIONS = _mutant(
    "mutant-sp-even-shard-positions",
    "sp",
    "shard offset = tp_rank * local_len",
    "shard offset computed as tp_rank * local_len (assumes even shards): right when seq_len % tp "
    "== 0, wrong positions on a short last shard (10 over 3 = 4/4/2: rank 2 starts at 4, not 8)",
    positions=_even_offset_positions,
    source="the even-shard assumption of SP/CP ports (PyTorch's CP tests assert seq_len % world_size == 0)",
)


def _loss_mean_per_rank(local_out, local_target, ctx):
    n = max(local_target.numel(), 1)
    return token_loss_sum(local_out, local_target) / n / ctx.tp  # BUG: mean of per-rank means


LOSS_MEAN = _mutant(
    "mutant-sp-loss-mean-per-rank",
    "sp",
    "loss = mean of per-rank means",
    "loss averaged over each rank's own tokens, then averaged across the TP ranks: a mean of "
    "means, which weights tokens on short shards more; right only for even shards",
    local_loss=_loss_mean_per_rank,
    source="DeepSpeed #7672 (SP loss aggregation); ms-swift PR #10185",
)
