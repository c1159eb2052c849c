"""Stage: step. Broken pieces more than one case family's mutants use (registers nothing): a loss
that weighs each rank's mean alike, and position ids that pass through the run dtype.

The positions-in-low-precision mutants (one per SP family, in its `precision_mutants.py`) are
exact in float32 and float64 and wrong only in low precision, where bfloat16 holds every integer
only up to 256: every float64 entry of the battery passes them; only its bfloat16 entry, whose
sequence is longer than 256 tokens, sees positions alias (257 -> 256, 259 -> 260: two tokens
share a position id, one is skipped).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sp_harness.config.case import Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.reference.gpt import token_loss_sum


def loss_mean_per_rank(local_out: torch.Tensor, local_target: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """BUG: the loss as the mean over the TP ranks of each rank's mean token loss (a mean of
    means): right only when every rank holds the same number of loss tokens."""
    n = max(local_target.numel(), 1)
    return token_loss_sum(local_out, local_target) / n / ctx.tp


POSITIONS_SOURCES = "huggingface/transformers#25681; huggingface/transformers PR #29285; nkalyanv99/UNI-D2 PR #6"
"""The positions-in-low-precision class: transformers#25681 (LlamaRotaryEmbedding built its
positions as `torch.arange(..., dtype=dtype)` in the model dtype), PR #29285 ('RoPE loses
precision for Llama / Gemma': positions autocast to bfloat16), UNI-D2 PR #6 ('positions above 256
can no longer represent every consecutive integer exactly. The position sequence starts to alias
or skip values')."""


def run_dtype(ref: nn.Module) -> torch.dtype:
    """The dtype of the run: the reference a shard factory is handed is already cast to it."""
    return next(ref.parameters()).dtype


def positions_input_through(dtype: torch.dtype, build: Callable[[nn.Module, RankContext], Sharded]
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
