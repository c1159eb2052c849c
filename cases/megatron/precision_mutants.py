"""Stage: config and step. Megatron-style SP's low-precision mutant: each shard's position ids
made by an arange in the run dtype, exact in float32/64, aliased in bfloat16 past 256 tokens (the
class: sp_harness.cases.common_mutants)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from sp_harness.cases.common_mutants import POSITIONS_SOURCES, run_dtype
from sp_harness.cases.megatron.cases import SP, megatron_shard
from sp_harness.cases.megatron.impl import CORRECT as MEGATRON
from sp_harness.config.case import Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant


# Any run in bfloat16 with a sequence longer than 256 tokens (float16: 2048) sees it.
def _offset_positions_in(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """Megatron's `Impl.positions` with the shard's arange made in `dtype`, then used as ids."""

    def positions(n_local: int, seq_sizes, shard_index: int, device) -> torch.Tensor:
        start = sum(seq_sizes[:shard_index])
        return torch.arange(start, start + n_local, dtype=dtype, device=device).long()

    return positions


def _sp_positions_in_run_dtype(ref: nn.Module, ctx: RankContext) -> Sharded:
    impl = dataclasses.replace(MEGATRON, positions=_offset_positions_in(run_dtype(ref)))
    return megatron_shard(impl, sequence_parallel=True)(ref, ctx)


SP_POSITIONS_BF16 = mutant(
    SP,
    name="mutant-sp-positions-bf16",
    summary="each shard's global position ids made by an arange in the run dtype (bf16)",
    bug="a sequence shard's global position ids built as torch.arange(start, start + n, dtype=<the "
        "activation dtype>): in bfloat16 the integers past 256 round (257 -> 256, 259 -> 260), so "
        "tokens share or skip positions and embed the wrong ones (huggingface/transformers#25681: "
        "LlamaRotaryEmbedding built `t = torch.arange(..., dtype=dtype)` in the model dtype; "
        "nkalyanv99/UNI-D2 PR #6: 'positions above 256 can no longer represent every consecutive "
        "integer exactly ... alias or skip values'; EleutherAI/gpt-neox#1003). Exact in float32/64",
    source=POSITIONS_SOURCES + "; EleutherAI/gpt-neox#1003",
    tags=("megatron", "low-precision"),
    shard=_sp_positions_in_run_dtype,
    killed_by=("forward", "bf16"),
)
