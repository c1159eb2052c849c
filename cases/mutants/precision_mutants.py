"""Mutants that are exact in float32 and float64 and wrong only in low precision: position ids
that pass through the run dtype, where bfloat16 holds every integer only up to 256.

Stage: config and step. In float64 (the battery's default dtype) each one computes exactly what its
twin computes, so every float64 entry passes; only the battery's bfloat16 entry, whose sequence is
longer than 256 tokens, sees positions alias (257 -> 256, 259 -> 260: two tokens share a position
id, one is skipped). One mutant per SP family: Megatron-style SP, Ulysses, ring, Ulysses x ring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from sp_harness.cases.megatron.cases import SP, megatron_shard
from sp_harness.cases.megatron.impl import CORRECT as MEGATRON
from sp_harness.cases.ring.cases import RING, ring_shard
from sp_harness.cases.ulysses.cases import ULYSSES, ulysses_shard
from sp_harness.cases.ulysses.model import CORRECT as ULYSSES_CORRECT
from sp_harness.cases.usp.cases import USP, usp_shard
from sp_harness.config.case import Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant

SOURCES = "huggingface/transformers#25681; huggingface/transformers PR #29285; nkalyanv99/UNI-D2 PR #6"
"""The positions-in-low-precision class: transformers#25681 (LlamaRotaryEmbedding built its
positions as `torch.arange(..., dtype=dtype)` in the model dtype), PR #29285 ('RoPE loses
precision for Llama / Gemma': positions autocast to bfloat16), UNI-D2 PR #6 ('positions above 256
can no longer represent every consecutive integer exactly. The position sequence starts to alias
or skip values')."""


def _run_dtype(ref: nn.Module) -> torch.dtype:
    """The dtype of the run: the reference a shard factory is handed is already cast to it."""
    return next(ref.parameters()).dtype


# Any run in bfloat16 with a sequence longer than 256 tokens (float16: 2048) sees each of these.
def _offset_positions_in(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """Megatron's `Impl.positions` with the shard's arange made in `dtype`, then used as ids."""

    def positions(n_local: int, seq_sizes, shard_index: int, device) -> torch.Tensor:
        start = sum(seq_sizes[:shard_index])
        return torch.arange(start, start + n_local, dtype=dtype, device=device).long()

    return positions


def _sp_positions_in_run_dtype(ref: nn.Module, ctx: RankContext) -> Sharded:
    impl = dataclasses.replace(MEGATRON, positions=_offset_positions_in(_run_dtype(ref)))
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
    source=SOURCES + "; EleutherAI/gpt-neox#1003",
    tags=("megatron", "low-precision"),
    shard=_sp_positions_in_run_dtype,
    killed_by=("forward", "bf16"),
)


def _positions_through_run_dtype(positions: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """The rank's position ids after a round trip through the run dtype."""
    return positions.to(ctx.config.torch_dtype).long()


ULYSSES_POSITIONS_BF16 = mutant(
    ULYSSES,
    name="mutant-ulysses-positions-bf16",
    summary="position ids cast to the run dtype (bf16) with the activations before embedding",
    bug="a rank's slice of the position ids moved with the floating inputs and cast to the model "
        "dtype on the way (position_ids.to(dtype)), then back to indices: in bfloat16 positions "
        "past 256 round to their even (then multiple-of-4) neighbour, so tokens embed the wrong "
        "positions (transformers PR #29285 'RoPE loses precision for Llama / Gemma' and #25681: "
        "positions materialised in bf16; nkalyanv99/UNI-D2 PR #6). Exact in float32/64",
    source=SOURCES,
    tags=("low-precision",),
    shard=ulysses_shard(dataclasses.replace(ULYSSES_CORRECT, positions=_positions_through_run_dtype)),
    killed_by=("forward", "bf16"),
)


def _positions_input_through(dtype: torch.dtype, build: Callable[[nn.Module, RankContext], Sharded]
                             ) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory `build` whose model casts its `positions` input to `dtype` and back to
    indices before it embeds them (a forward pre-hook: weights, names and the rest untouched)."""

    def cast(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "positions" in kwargs:
            kwargs = dict(kwargs, positions=kwargs["positions"].to(dtype).long())
        elif len(args) > 1:
            args = (args[0], args[1].to(dtype).long(), *args[2:])
        return args, kwargs

    def shard(ref: nn.Module, ctx: RankContext) -> Sharded:
        sharded = build(ref, ctx)
        sharded.module.register_forward_pre_hook(cast, with_kwargs=True)
        return sharded

    return shard


RING_POSITIONS_BF16 = mutant(
    RING,
    name="mutant-ring-positions-bf16",
    summary="zigzag-placed position ids cast to the run dtype (bf16) before embedding",
    bug="a context-parallel rank's position ids (under zigzag both ends of the sequence, so every "
        "rank holds positions past 256) cast to the model dtype with the inputs and back to "
        "indices: in bfloat16 they alias, tokens embed a neighbour's position (the "
        "positions-in-low-precision class: transformers#25681, PR #29285, UNI-D2 PR #6). "
        "Exact in float32/64",
    source=SOURCES,
    tags=("ring", "low-precision"),
    shard=lambda ref, ctx: _positions_input_through(_run_dtype(ref), ring_shard())(ref, ctx),
    killed_by=("forward", "bf16"),
)


USP_POSITIONS_BF16 = mutant(
    USP,
    name="mutant-usp-positions-bf16",
    summary="hybrid Ulysses x ring: position ids cast to the run dtype (bf16) before embedding",
    bug="a hybrid (Ulysses x ring) rank's position ids cast to the model dtype with the inputs and "
        "back to indices: in bfloat16 positions past 256 alias and tokens embed a neighbour's "
        "position (the positions-in-low-precision class: transformers#25681, PR #29285, UNI-D2 "
        "PR #6). Exact in float32/64",
    source=SOURCES,
    tags=("low-precision",),
    shard=lambda ref, ctx: _positions_input_through(_run_dtype(ref), usp_shard())(ref, ctx),
    killed_by=("forward", "bf16"),
)
