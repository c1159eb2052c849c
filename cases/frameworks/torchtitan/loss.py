"""Stage: step. Your loss and your batch (`token_loss.TokenLoss`) through torchtitan
(`torchtitan_case(..., loss=TokenLoss(...))`): the batch its datasets hand the trainer, and the
loss each rank computes as torchtitan's trainer computes it.

    from sp_harness.cases.frameworks.token_loss import TokenLoss
    CASE = torchtitan_case("my-titan", SHAPES, loss=TokenLoss(masked_fraction=0.25, padding=2))

- The batch: the case's tokens and labels, then `mask_labels`: torchtitan's `IGNORE_INDEX` (-100,
  what its SFT datasets write over prompt tokens and padding) on the trailing `padding` positions
  (their tokens `PAD_TOKEN`) and on `masked_fraction` of the rest. torchtitan's language models
  are causal, so trailing pads need no attention mask: no earlier token attends to them.
- A rank's loss: torchtitan's own `components.loss.cross_entropy_loss` (sum reduction, float32,
  `IGNORE_INDEX` skipped) on what its model hands it: the vocab-parallel logits (a `Shard(-1)`
  DTensor on the partial_dtensor backend, plain local shards under spmd_types: its
  `_LossParallelCrossEntropy` either way), or the sequence shard under context parallelism;
  divided by the valid-token count of the rank's replica, as the trainer divides by
  `global_valid_tokens` (the labels' count `!= IGNORE_INDEX`, taken before the CP cut).
- Your own per-token loss (`TokenLoss.loss_fn`, torchtitan's `loss_fn` slot): called on the whole
  logits, gathered over TP first (what a user's loss that calls `full_tensor()` sees), in the run
  dtype; the same valid-token divisor.
- The reference: the same `TokenLoss` on the float64 reference's logits (`token_loss.loss_sum`),
  over the same count.

torchtitan's cross entropy has no label smoothing and skips -100 alone, so `label_smoothing`
without a `loss_fn`, or another `ignore_index`, is a ValueError at the case's construction; its
float32 cast makes a float64 run with it Unsupported (`loss_limits`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sp_harness import Unsupported
from sp_harness.cases.frameworks.token_loss import TokenLoss, loss_sum, mask_labels, valid_tokens
from sp_harness.cases.megatron.mappings import gather_to_whole

IGNORE_INDEX = -100
"""torchtitan's `components.loss.IGNORE_INDEX`: the only label its cross entropy skips."""
PAD_TOKEN = 0
"""The token id at the trailing pad positions."""
COUNTS = ("valid", "all")
"""A rank's loss divisor: its replica's valid tokens (torchtitan's), or every label position,
masked ones included (a mutant's)."""
CE_FLOAT32 = ("torchtitan's cross_entropy_loss casts the logits to float32 (components/loss.py, `.float()`): its "
              "loss and the grads it sends back are float32 in a float64 run; a TokenLoss(loss_fn=...) runs in the "
              "run dtype")
"""Why a float64 run with torchtitan's cross entropy is Unsupported."""


def check_loss(name: str, loss: TokenLoss) -> None:
    """A ValueError, at the case's construction, for a `TokenLoss` torchtitan cannot compute."""
    if loss.ignore_index != IGNORE_INDEX:
        raise ValueError(f"torchtitan_case({name!r}): TokenLoss.ignore_index {loss.ignore_index}; torchtitan's "
                         f"cross entropy and its trainer's valid-token count skip {IGNORE_INDEX} only")
    if loss.label_smoothing and loss.loss_fn is None:
        raise ValueError(f"torchtitan_case({name!r}): TokenLoss.label_smoothing {loss.label_smoothing}; "
                         "torchtitan's cross_entropy_loss has no label smoothing: give TokenLoss(loss_fn=...) "
                         "with your smoothed loss (torchtitan's loss_fn slot)")


def loss_limits(cfg, loss: TokenLoss) -> str | None:
    """Why a run config cannot be verified with `loss` (None: it can); a ValueError for a padding
    that leaves no position."""
    seq_len = cfg.seq_len or 0
    if loss.padding >= seq_len:
        raise ValueError(f"TokenLoss.padding {loss.padding} leaves no position of a {seq_len}-token sequence")
    if cfg.dtype == "float64" and loss.loss_fn is None:
        return CE_FLOAT32
    return None


def titan_batch(loss: TokenLoss, tokens: torch.Tensor, labels: torch.Tensor,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) with `loss`'s masks: trailing pads (`PAD_TOKEN`, label ignored) and
    `masked_fraction` of the rest ignored. A default `TokenLoss` draws nothing more."""
    labels = mask_labels(loss, labels, gen)
    if loss.padding:
        tokens = tokens.clone()
        tokens[:, tokens.shape[1] - loss.padding:] = PAD_TOKEN
    return tokens, labels


def case_loss_fields(loss: TokenLoss) -> dict[str, Any]:
    """The reference's loss: `loss`'s token losses on its (float64) logits over the valid labels."""
    return {"loss_sum": lambda logits, labels: loss_sum(loss, logits, labels),
            "tokens": lambda labels: valid_tokens(loss, labels)}


def _divisor(loss: TokenLoss, labels: torch.Tensor, count: str, seq_group) -> int:
    """The replica's valid labels (or every label, `count="all"`), summed over `seq_group` where
    the labels are a sequence shard (CP)."""
    n = torch.tensor([valid_tokens(loss, labels) if count == "valid" else labels.numel()], dtype=torch.int64)
    if seq_group is not None:
        dist.all_reduce(n, group=seq_group)
    return int(n.item())


def titan_local_loss(loss: TokenLoss, *, vocab: int | None = None, vocab_mesh: Callable[[], Any] | None = None,
                     spmd_mesh: Callable[[], Any] | None = None, seq_sharded: bool = False,
                     count: str = "valid") -> Callable[..., torch.Tensor]:
    """`Sharded.local_loss` for `loss` on torchtitan. The output it is given: the local vocab shard
    of the rank's TP group where `vocab` (the global size) is given (vocab-parallel logits), else
    the whole vocabulary, of the rank's sequence shard where `seq_sharded` (CP: the engine's TP
    group is the CP group). `vocab_mesh()`: the 1-D TP mesh to re-wrap the shard as torchtitan's
    `Shard(-1)` DTensor (partial_dtensor); `spmd_mesh()`: the dense mesh `cross_entropy_loss` finds
    current (spmd_types). `count="all"`: the divisor counts masked labels too (a mutant's)."""
    if count not in COUNTS:
        raise ValueError(f"count {count!r}: one of {COUNTS}")

    def local(logits: torch.Tensor, labels: torch.Tensor, ctx) -> torch.Tensor:
        from torchtitan.components.loss import cross_entropy_loss

        divisor = _divisor(loss, labels, count, ctx.tp_group if seq_sharded and ctx.tp > 1 else None)
        if loss.loss_fn is not None:
            if vocab is not None and ctx.tp > 1:
                sizes = [c.numel() for c in torch.empty(vocab, device="meta").chunk(ctx.tp)]
                logits = gather_to_whole(logits, -1, sizes, ctx.tp_group)
            return loss_sum(loss, logits, labels) / divisor
        if vocab_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            whole = (*logits.shape[:-1], vocab)
            logits = DTensor.from_local(logits, vocab_mesh(), (Shard(logits.ndim - 1),), run_check=False,
                                        shape=torch.Size(whole), stride=torch.empty(whole, device="meta").stride())
        current = contextlib.nullcontext()
        if spmd_mesh is not None:
            from torchtitan.distributed.spmd_types import set_current_spmd_mesh

            current = set_current_spmd_mesh(spmd_mesh())
        with current:
            return cross_entropy_loss(logits, labels, global_vocab_size=vocab) / divisor

    return local


def check_unsupported(cfg, loss: TokenLoss | None) -> None:
    """`loss_limits` as an `Unsupported` (a case's validate)."""
    if loss is not None and (why := loss_limits(cfg, loss)) is not None:
        raise Unsupported(why)


__all__ = ["CE_FLOAT32", "COUNTS", "IGNORE_INDEX", "PAD_TOKEN", "case_loss_fields", "check_loss", "check_unsupported",
           "loss_limits", "titan_batch", "titan_local_loss"]
