"""Stage: config and step. Ulysses' low-precision mutant: position ids cast to the run dtype with
the activations, exact in float32/64, aliased in bfloat16 past 256 tokens (the class:
sp_harness.cases.common_mutants)."""

from __future__ import annotations

import dataclasses

import torch

from sp_harness.cases.common_mutants import POSITIONS_SOURCES
from sp_harness.cases.ulysses.cases import ULYSSES, ulysses_shard
from sp_harness.cases.ulysses.model import CORRECT as ULYSSES_CORRECT
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant


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
    source=POSITIONS_SOURCES,
    tags=("low-precision",),
    shard=ulysses_shard(dataclasses.replace(ULYSSES_CORRECT, positions=_positions_through_run_dtype)),
    killed_by=("forward", "bf16"),
)
