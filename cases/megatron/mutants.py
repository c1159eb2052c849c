"""Broken variants of the Megatron-style GPT: each is `CORRECT` with one `Impl` piece swapped.

Stage: config and step. Every mutant is a registered Case tagged "mutant" whose `models_bug` names
the real bug it models. Which configs expose each one is in the docstring next to it; the
default suite must kill all of them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from sp_harness.cases.common_mutants import loss_mean_per_rank
from sp_harness.cases.megatron.cases import SP, TP, megatron_shard
from sp_harness.cases.megatron.impl import CORRECT, SP_KINDS, sync_grads
from sp_harness.config.registry import mutant

TAGS = ("mutant", "megatron")


def megatron_mutant(name: str, mode: str, short: str, bug: str, *, source: str, killed_by: tuple[str, ...] = (),
                    **swap):
    """`CORRECT` with the `Impl` fields in `swap` replaced, as a mutant of the TP or SP case."""
    impl = dataclasses.replace(CORRECT, **swap)
    base = SP if mode == "sp" else TP
    return mutant(base, name=name, summary=short, bug=bug, source=source, killed_by=killed_by,
                  shard=megatron_shard(impl, sequence_parallel=mode == "sp"))


# ----------------------------------------------------------------- grad sync of SP params
# Visible at tp > 1 under SP (any seq split): the replicated params drift apart across TP.

NO_NORM_SYNC = megatron_mutant(
    "mutant-sp-no-norm-grad-sync",
    "sp",
    "norm grads not summed over TP",
    "norm weight/bias grads not all-reduced over TP under SP: each rank's norm sees only its "
    "sequence shard, so its grad is a partial sum (GPT-NeoX PR #1257 shipped Megatron-style SP "
    "without the sync, fixed in PR #1259 'Fix LayerNorm all reduce gradient hook'; Megatron's "
    "allreduce_layernorm_grads, see NVIDIA/Megatron-LM#443, NVIDIA/TransformerEngine#435)",
    sequence_parallel_kinds=SP_KINDS - {"norm"},
    source="GPT-NeoX PR #1257 / #1259; NVIDIA/Megatron-LM#443; NVIDIA/TransformerEngine#435",
    killed_by=("grad", "even"),
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


NORM_SYNC_LOST_AT_STEP_3 = megatron_mutant(
    "mutant-sp-norm-sync-lost-at-step-3",
    "sp",
    "norm grads dropped from the TP sync from the third step on",
    "norm grads dropped from the SP grad sync from the third iteration on: PyTorch DDP rebuilds "
    "its grad buckets after the first iteration (Reducer::rebuild_buckets), and grad-sync "
    "schemes that rebuild or re-register hooks later can leave params out of the new bucket; "
    "a check of only two steps never sees it (GPT-NeoX #1257's unsynced norms, appearing late)",
    sync_grads=_sync_grads_rebuilt_bucket,
    source="PyTorch DDP Reducer::rebuild_buckets; GPT-NeoX #1257's unsynced norms",
    killed_by=("grad", "even"),
)


NORM_SYNC_DP = megatron_mutant(
    "mutant-sp-norm-grad-sync-dp-group",
    "sp",
    "SP grads summed over DP instead of TP",
    "SP grads of norms and other shard-applied params summed over the DP group instead of TP; "
    "the right collective on the wrong process group (the group= mix-up class; GPT-NeoX PR #1259 "
    "also had to fix that hook, which averaged instead of summing)",
    sp_grad_group=lambda ctx: ctx.dp_group,
    source="GPT-NeoX PR #1259 (the hook's group and reduction)",
    killed_by=("grad", "even"),
)

NO_ROW_BIAS_SYNC = megatron_mutant(
    "mutant-sp-no-row-bias-grad-sync",
    "sp",
    "row-parallel bias grads not summed over TP",
    "row-parallel bias grads not all-reduced over TP under SP; the bias of out_proj and fc2 is "
    "added after the reduce-scatter, on each rank's shard, so its grad is partial (Megatron marks "
    "it `sequence_parallel` in RowParallelLinear for this reason)",
    sequence_parallel_kinds=SP_KINDS - {"row_bias"},
    source="Megatron-LM RowParallelLinear marks its bias `sequence_parallel` for this sync",
    killed_by=("grad", "even"),
)

NO_EMBEDDING_SYNC = megatron_mutant(
    "mutant-sp-no-embedding-grad-sync",
    "sp",
    "embedding grads not summed over TP",
    "token/position embedding grads not all-reduced over TP when the tokens arrive "
    "sequence-sharded: Megatron embeds the full sequence then scatters, so porting its sync list "
    "to an embed-the-shard model forgets the embeddings",
    sequence_parallel_kinds=SP_KINDS - {"embedding"},
    source="Megatron-LM embeds the full sequence, then scatters: its sync list has no embedding entry for SP",
    killed_by=("grad", "even"),
)


# ----------------------------------------------------------------- row-parallel bias


def _bias_before_reduce(x, weight, bias, reduce):
    return reduce(F.linear(x, weight, bias))  # BUG: every rank adds the bias, then the sum


ROW_BIAS_BEFORE = megatron_mutant(
    "mutant-sp-row-bias-before-reduce",
    "sp",
    "row-parallel bias added before reduce-scatter",
    "row-parallel bias added on every rank before the reduce-scatter, so the output carries "
    "tp x bias (Megatron's RowParallelLinear adds the bias after the reduction for this reason)",
    row_parallel=_bias_before_reduce,
    source="Megatron-LM RowParallelLinear adds the bias after the reduction",
    killed_by=("forward", "even"),
)

TP_ROW_BIAS_BEFORE = megatron_mutant(
    "mutant-tp-row-bias-before-reduce",
    "tp",
    "row-parallel bias added before all-reduce",
    "row-parallel bias added on every rank before the all-reduce, so the output carries "
    "tp x bias (Megatron's RowParallelLinear adds the bias after the reduction for this reason)",
    row_parallel=_bias_before_reduce,
    source="Megatron-LM RowParallelLinear adds the bias after the reduction",
    killed_by=("forward", "even"),
)


# ----------------------------------------------------------------- positions and loss


def _local_positions(n_local, seq_sizes, shard_index, device):
    return torch.arange(n_local, device=device)  # BUG: every shard starts at position 0


LOCAL_POSITIONS = megatron_mutant(
    "mutant-sp-local-positions",
    "sp",
    "position ids local, not global",
    "position ids from the local shard (0..n_local-1) instead of the shard's global offset: every "
    "rank but the first embeds the wrong positions (the position_ids-not-offset bug class of "
    "sequence/context-parallel ports)",
    positions=_local_positions,
    source="the position_ids-not-offset class of sequence/context-parallel ports",
    killed_by=("forward", "even"),
)


def _even_offset_positions(n_local, seq_sizes, shard_index, device):
    start = shard_index * n_local  # BUG: assumes every shard has n_local tokens
    return torch.arange(start, start + n_local, device=device)


EVEN_POSITIONS = megatron_mutant(
    "mutant-sp-even-shard-positions",
    "sp",
    "shard offset = tp_rank * local_len",
    "shard offset computed as tp_rank * local_len (assumes even shards): right when seq_len % tp "
    "== 0, wrong positions on a short last shard (10 over 3 = 4/4/2: rank 2 starts at 4, not 8)",
    positions=_even_offset_positions,
    source="the even-shard assumption of SP/CP ports (PyTorch's CP tests assert seq_len % world_size == 0)",
    killed_by=("forward", "uneven"),
)


LOSS_MEAN = megatron_mutant(
    "mutant-sp-loss-mean-per-rank",
    "sp",
    "loss = mean of per-rank means",
    "loss averaged over each rank's own tokens, then averaged across the TP ranks: a mean of "
    "means, which weights tokens on short shards more; right only for even shards",
    local_loss=loss_mean_per_rank,
    source="DeepSpeed #7672 (SP loss aggregation); ms-swift PR #10185",
    killed_by=("forward (loss)", "uneven"),
)
