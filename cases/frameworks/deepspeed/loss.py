"""Stage: step. Your loss and your batch (`token_loss.TokenLoss`) through the Ulysses cases of
DeepSpeed (`ulysses_case`, `ulysses_module_case`, `hf_ulysses_case`) and yunchang (`usp_case`,
`ulysses_case`): the batch a user's collator hands a sequence-parallel model, the loss each SP
rank computes on its shard, and the reference's loss on the whole batch, in float64.

    from sp_harness.cases.frameworks.token_loss import TokenLoss
    CASE = ulysses_case("my-ds", loss=TokenLoss(label_smoothing=0.1, masked_fraction=0.25, padding=2))

- The batch: the GPT cases' tokens and next-token labels (the prompt's labels at -100), then
  `mask_labels`: `ignore_index` on the trailing `padding` positions (their tokens the pad id 0)
  and on `masked_fraction` of the rest. Causal attention needs no mask for trailing pads: no
  earlier token attends to them, and their labels carry no loss. DeepSpeed's ALST takes
  `position_ids`, not an attention mask, for exactly this; non-causal attention with padding is
  UNSUPPORTED (neither `DistributedAttention`'s local attention nor yunchang's layers take a
  key-padding mask).
- A rank's loss (`sp_local_loss`): its shard's token-loss sum over the valid tokens of its whole
  DP replica, that count all-reduced over the SP group: the token mean over the sequence, as an
  ALST user computes it (huggingface/transformers#41832 weights each shard's loss by its valid
  tokens for this), and what the engine's grad sum over SP then completes. `normalise="shard"`
  divides by the shard's own count instead (a mutant's: the shards' means summed).
- The reference: the same `TokenLoss` on the float64 reference's logits (`token_loss.loss_sum`),
  divided by the same global count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sp_harness import Unsupported
from sp_harness.cases.common import IGNORE_INDEX, gpt_batch, with_defaults, with_positions
from sp_harness.cases.frameworks.token_loss import TokenLoss, loss_sum, mask_labels, valid_tokens

PAD_TOKEN = 0
"""The token id a collator writes at the trailing pad positions."""

NORMALISATIONS = ("global", "shard")


def token_batch(loss: TokenLoss, cfg, step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPT cases' (tokens, labels) (B, S), masked as `loss` says: the prompt's labels at
    `loss.ignore_index`, trailing pads (token `PAD_TOKEN`, label ignored), `masked_fraction` of
    the rest ignored. A default `TokenLoss` leaves the batch as `gpt_batch` draws it."""
    tokens, labels = gpt_batch(cfg, step, gen)
    labels = labels.masked_fill(labels == IGNORE_INDEX, loss.ignore_index)
    labels = mask_labels(loss, labels, gen)
    if loss.padding:
        tokens[:, tokens.shape[1] - loss.padding:] = PAD_TOKEN
    return tokens, labels


def loss_limits(cfg, loss: TokenLoss) -> None:
    """What a `TokenLoss` asks of the run, as `Unsupported` or a ValueError with the numbers."""
    seq_len = cfg.seq_len or 0
    if loss.padding and loss.padding >= seq_len:
        raise ValueError(f"TokenLoss.padding {loss.padding} leaves no position of a {seq_len}-token sequence")
    if loss.padding and cfg.causal is False:
        raise Unsupported(f"TokenLoss.padding {loss.padding} with non-causal attention needs a key-padding mask, "
                          f"which the local attention here does not take (q, k, v only); causal attention "
                          f"needs none for trailing pads")


def case_loss_fields(loss: TokenLoss) -> dict[str, Any]:
    """The `Case` fields the reference's loss comes from: `loss_sum` (the token losses of `loss`
    on the logits, float64 in the reference) and `tokens` (the valid labels)."""
    return {"loss_sum": lambda logits, labels: loss_sum(loss, logits, labels),
            "tokens": lambda labels: valid_tokens(loss, labels)}


def gpt_loss_fields(loss: TokenLoss, defaults) -> dict[str, Any]:
    """The fields a `gpt_fields` case (tokens and positions in: yunchang's) takes for `loss`: its
    batch masked by it (the config filled from `defaults` first) and `case_loss_fields`."""

    def make_batch(config, step: int, gen: torch.Generator):
        return with_positions(*token_batch(loss, with_defaults(config, defaults), step, gen))

    return {"make_batch": make_batch, **case_loss_fields(loss)}


def sp_local_loss(loss: TokenLoss, normalise: str = "global") -> Callable[..., torch.Tensor]:
    """`Sharded.local_loss`: this SP rank's token-loss sum over its DP replica's valid tokens
    (the shard counts all-reduced over the SP group); `normalise="shard"`: over its own."""
    if normalise not in NORMALISATIONS:
        raise ValueError(f"normalise {normalise!r}: one of {NORMALISATIONS}")

    def local(logits: torch.Tensor, labels: torch.Tensor, ctx) -> torch.Tensor:
        count = torch.tensor([valid_tokens(loss, labels)], dtype=torch.int64)
        if normalise == "global":
            dist.all_reduce(count, group=ctx.tp_group)
        return loss_sum(loss, logits, labels) / count.item()

    return local


__all__ = ["NORMALISATIONS", "PAD_TOKEN", "case_loss_fields", "gpt_loss_fields", "loss_limits", "sp_local_loss", "token_batch"]
