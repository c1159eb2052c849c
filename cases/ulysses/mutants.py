"""Broken variants of the Ulysses GPT: each is `CORRECT` with one `Impl` piece swapped.

Stage: config and step. Which configs expose each one is in the docstring next to it; the default
battery must kill all of them (pinned in tests/test_mutants.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from sp_harness.cases.common import sum_replicated_grads
from sp_harness.cases.common_mutants import loss_mean_per_rank
from sp_harness.cases.ulysses import mappings
from sp_harness.cases.ulysses.cases import ULYSSES, ulysses_shard
from sp_harness.cases.ulysses.model import CORRECT
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant
from sp_harness.reference.gpt import token_loss_sum


def ulysses_mutant(name: str, summary: str, bug: str, *, source: str, killed_by: tuple[str, ...] = (), **swap):
    """`CORRECT` with the `Impl` fields in `swap` replaced, as a mutant of ulysses-gpt."""
    impl = dataclasses.replace(CORRECT, **swap)
    return mutant(ULYSSES, name=name, summary=summary, bug=bug, source=source, killed_by=killed_by,
                  shard=ulysses_shard(impl))


# ----------------------------------------------------------------- (a) even-shard all-to-all
# Right whenever seq_len % sp == 0; 10 tokens over 3 ranks (4/4/2) sizes every piece as 3.


def _even_seq_sizes(ctx):
    s = sum(ctx.seq_shards)
    return (s // ctx.tp,) * ctx.tp  # BUG: every rank assumed to hold seq_len // sp tokens


EVEN_SPLITS = ulysses_mutant(
    "mutant-ulysses-a2a-assumes-even",
    "all-to-all sized seq_len // sp per rank",
    "the all-to-all's per-rank pieces sized seq_len // sp (DeepSpeed's original _SeqAllToAll "
    "splits with torch.tensor_split into equal chunks and asserts divisibility): with uneven "
    "shards the split sizes disagree with the tensors, so a rank raises or the exchange corrupts",
    seq_sizes=_even_seq_sizes,
    source="prime-rl PR #2946 (uneven Ulysses shards); DeepSpeed #5177 (sequence length not divisible by SP size)",
    killed_by=("crash", "uneven"),
)


# ----------------------------------------------------------------- (b) GQA k/v head assignment
# Right when num_kv_heads >= sp or num_kv_heads == 1; the default (4 heads, 2 k/v heads) over
# 3 ranks gives query heads 2/1/1, whose k/v heads are 0/1/1: this assignment hands rank 2 k/v head 0.


def _kv_heads_tiled(q_heads, num_heads, num_kv_heads):
    if num_kv_heads >= len(q_heads):
        return mappings.kv_heads(q_heads, num_heads, num_kv_heads)
    # BUG: k/v heads replicated to the SP degree by tiling (k.repeat: 0,1,0,1,...) instead of
    # repeat_interleave (0,0,1,1,...): rank r gets k/v head r % num_kv_heads
    return tuple((r % num_kv_heads,) if h else () for r, h in enumerate(q_heads))


def _kv_index_interleaved_locally(mine_q, mine_kv, group):
    # and locally each rank spreads the k/v heads it got over its query heads (repeat_kv by
    # h_r / kv_r), trusting that it got the right ones
    return [i * len(mine_kv) // len(mine_q) for i in range(len(mine_q))]


GQA_TILED = ulysses_mutant(
    "mutant-ulysses-gqa-kv-heads-tiled",
    "k/v heads replicated by tiling when sp > num_kv_heads",
    "grouped-query attention with fewer k/v heads than Ulysses ranks: the k/v heads are "
    "replicated to the SP degree in the wrong order (tiled, k/v head r % num_kv_heads on rank r, "
    "where query heads group contiguously and need repeat_interleave), so some ranks attend with "
    "another group's k/v head; verl's Ulysses requires sp % num_kv_heads == 0 and repeats kv to "
    "sp (verl #1226), VeOmni PR #162 fixed repeat_kv applied along the wrong dim",
    kv_heads=_kv_heads_tiled,
    kv_index=_kv_index_interleaved_locally,
    source="verl #1226; VeOmni PR #162 (repeat kv bug with ulysses); prime-rl PR #3042 (repeat_interleave index algebra)",
    killed_by=("forward", "uneven"),
)


# ----------------------------------------------------------------- (c) backward split order
# Right on even shards and heads (every piece the same size); uneven ones misroute grads.


def _heads_to_seq_forward_order(grad, heads_for, seq_sizes, num_heads, group):
    """`mappings.heads_to_seq` (the right backward of seq->heads) with one line changed: the
    pieces it expects back are sized by the forward's receive sizes (my heads x rank j's
    tokens) instead of the swapped ones (rank j's heads x my tokens)."""
    me = mappings._rank(group)
    b, mine, _, d = grad.shape
    s_r = seq_sizes[me]
    pieces = list(grad.split(list(seq_sizes), dim=2))  # to rank j: (B, h_r, s_j, d)
    got = mappings.exchange(pieces, [b * mine * s * d for s in seq_sizes], group)  # BUG: not swapped
    out = grad.new_zeros(b, num_heads, s_r, d)  # (B, A, s_r, d)
    for g, h in zip(got, heads_for, strict=True):
        if h:
            out.index_add_(1, torch.tensor(h, device=grad.device), g.view(b, len(h), s_r, d))
    return out


class _SeqToHeadsForwardOrder(torch.autograd.Function):
    """forward: all-to-all seq->heads; backward: an all-to-all with the FORWARD's split sizes."""

    @staticmethod
    def forward(ctx, x, heads_for, seq_sizes, group):
        ctx.heads_for, ctx.seq_sizes, ctx.group, ctx.num_heads = heads_for, seq_sizes, group, x.shape[1]
        return mappings.seq_to_heads(x, heads_for, seq_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq_forward_order(grad, ctx.heads_for, ctx.seq_sizes, ctx.num_heads, ctx.group), None, None, None


def _seq_to_heads_forward_order(x, heads_for, seq_sizes, group):
    return _SeqToHeadsForwardOrder.apply(x, tuple(map(tuple, heads_for)), tuple(seq_sizes), group)


BACKWARD_FORWARD_SPLITS = ulysses_mutant(
    "mutant-ulysses-backward-forward-splits",
    "backward all-to-all reuses the forward's split sizes",
    "the backward of the seq->heads all-to-all issues the exchange with the forward's input/"
    "output split sizes instead of swapping them (heads<->seq): identical when every piece has "
    "the same size (even shards and heads), misrouted or mis-sized grads otherwise; the conjugate "
    "must swap them, as torch.distributed.nn.functional's all_to_all_single backward does and "
    "as Horovod's alltoall gradient had to learn (it now reuses the forward's received splits)",
    seq_to_heads=_seq_to_heads_forward_order,
    source="horovod PR #2631 (alltoall gradient split sizes); DeepSpeed _SeqAllToAll.backward swaps scatter/gather idx",
    killed_by=("crash", "uneven"),
)


# ----------------------------------------------------------------- (d) loss aggregation
# Right on even shards; a mean of per-rank means weights the tokens of short shards more.


LOSS_MEAN = ulysses_mutant(
    "mutant-ulysses-loss-mean-per-rank",
    "loss = mean of per-rank means",
    "SP loss aggregated as the mean over ranks of each rank's mean token loss: a mean of means, "
    "right only when every rank holds the same number of loss tokens",
    local_loss=loss_mean_per_rank,
    source="DeepSpeed #7672 (Ulysses SP loss aggregation)",
    killed_by=("forward (loss)", "uneven"),
)


def _loss_shift_per_shard(local_out, local_target, ctx):
    # a port that shifts labels on its own shard (logits[:, :-1] vs ids[:, 1:]) loses the
    # prediction whose label is the next shard's first token; with pre-shifted targets that is
    # dropping each shard's last position. Normalised by the global count, as the engine does.
    tokens = ctx.config.batch * ctx.config.seq_len
    return token_loss_sum(local_out[:, :-1], local_target[:, :-1]) / tokens  # BUG: boundary token lost


LABEL_SHIFT_PER_SHARD = ulysses_mutant(
    "mutant-ulysses-label-shift-per-shard",
    "labels shifted within each shard",
    "next-token labels shifted inside each sequence shard instead of once on the full sequence: "
    "the last position of every shard (whose label is the first token of the next shard) drops "
    "out of the loss",
    local_loss=_loss_shift_per_shard,
    source="ms-swift PR #10185 (label shift under sequence parallelism)",
    killed_by=("forward (loss)", "even"),
)


# ----------------------------------------------------------------- (e) grads not all-reduced over SP
# Visible at sp > 1, any split: each rank steps with its partial grads; replicas drift apart.


def _sync_dp_only(module: nn.Module, ctx: RankContext) -> None:
    sum_replicated_grads(module, ctx, over=())  # BUG: no SUM over the SP group, only the DP average


NO_SP_GRAD_SYNC = ulysses_mutant(
    "mutant-ulysses-no-sp-grad-sync",
    "replicated param grads not summed over SP",
    "grads of the replicated parameters not all-reduced over the SP group: each rank's loss covers "
    "only its tokens, so its grads are partial sums (DeepSpeed registers the SP group as part of "
    "the data-parallel grad reduction for this; a plain DDP over the DP group alone misses it)",
    sync_grads=_sync_dp_only,
    source="DeepSpeed-Ulysses (arXiv:2309.14509): grads reduced over the sequence-data-parallel group; GPT-NeoX PR #1257 (the same partial-grad class for norms)",
    killed_by=("grad", "even"),
)


# ----------------------------------------------------------------- (f) local positions
# Visible on every rank but the first, any split.


def _local_positions(positions, ctx):
    return positions - positions[:, :1]  # BUG: position ids restart at 0 on every shard


LOCAL_POSITIONS = ulysses_mutant(
    "mutant-ulysses-local-positions",
    "position ids local, not offset by the shard start",
    "position ids of a sequence shard computed locally (0..s_r-1, not offset by the shard's start): "
    "every rank but the first embeds the wrong positions (the position_ids-not-offset class of "
    "sequence/context-parallel ports)",
    positions=_local_positions,
    source="the position_ids-not-offset class of SP/CP ports (a correct port slices GLOBAL position ids per "
           "rank, as verl's ulysses_pad_and_slice_inputs slices position_ids with input_ids)",
    killed_by=("forward", "even"),
)
