"""Stage: step. Broken pieces more than one family's mutants use (registers nothing)."""

from __future__ import annotations

import torch

from sp_harness.config.rank_context import RankContext
from sp_harness.reference.gpt import token_loss_sum


def loss_mean_per_rank(local_out: torch.Tensor, local_target: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """BUG: the loss as the mean over the TP ranks of each rank's mean token loss (a mean of
    means): right only when every rank holds the same number of loss tokens."""
    n = max(local_target.numel(), 1)
    return token_loss_sum(local_out, local_target) / n / ctx.tp
