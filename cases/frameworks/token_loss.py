"""Stage: config. "Your loss and your batch", framework-neutral: the token loss a user trains with
(labels with a loss mask, label smoothing, trailing padding under an attention mask, a loss
function of their own) as data, and the reference side of it. Each framework integration passes
it the way that framework's users do (megatron-core's `labels` / `loss_mask` and loss function,
DeepSpeed's and Hugging Face's `labels` with -100, ...); the reference computes the same loss
from the same batch with the functions here, in float64, or in the float32 island the framework
keeps (the caller casts the logits: megatron's vocab-parallel cross entropy is float32 whatever
the run dtype).

    from sp_harness.cases.frameworks.token_loss import TokenLoss
    LOSS = TokenLoss(label_smoothing=0.1, masked_fraction=0.25, padding=2)

The generated batch masks the same number of label positions in every sequence
(`mask_labels`), so every DP replica holds the same number of valid tokens: a loss normalised
per replica and one normalised by the global valid-token count are then the same loss, and both
PASS when correct. Where they differ (uneven valid tokens) is the training-step check's to judge
(its micro-batches are drawn uneven on purpose).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Smoothing = Literal["uniform", "others"]
"""How a framework spreads label smoothing's epsilon: 'uniform' over every class, the target's
included (torch's `F.cross_entropy`, what Hugging Face and DeepSpeed users call); 'others' over
the V - 1 other classes (megatron-core's `vocab_parallel_cross_entropy`, NeMo's: the coefficient
is epsilon * V / (V - 1)). The same epsilon is a different loss under each."""
SMOOTHINGS: tuple[Smoothing, ...] = ("uniform", "others")


@dataclass(kw_only=True, frozen=True)
class TokenLoss:
    """The user's per-token loss and what their batch carries. All defaults: plain cross entropy
    over every position, nothing masked."""

    label_smoothing: float = 0.0
    """Label smoothing's epsilon, 0 <= x < 1, in the framework's own convention (`Smoothing`)."""
    ignore_index: int = -100
    """Labels equal to it carry no loss (a loss mask, padding); never a class id."""
    masked_fraction: float = 0.0
    """The fraction of each sequence's unpadded label positions the generated batch masks
    (floor(fraction x positions), the same count in every sequence, positions drawn at random),
    0 <= x < 1: a prompt or a document boundary's loss mask."""
    padding: int = 0
    """Trailing pad positions per sequence: attention-masked (no other position attends to them)
    and their labels ignored."""
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None
    """The user's own per-token loss: (logits (..., V), labels (...)) -> losses (...), called with
    labels that are valid class ids everywhere (ignored positions hold 0 and are zeroed after);
    None: cross entropy with `label_smoothing`. It must be differentiable and dtype-preserving:
    the reference calls it on float64 logits."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"TokenLoss.label_smoothing {self.label_smoothing}: needs 0 <= x < 1")
        if not 0.0 <= self.masked_fraction < 1.0:
            raise ValueError(f"TokenLoss.masked_fraction {self.masked_fraction}: needs 0 <= x < 1 "
                             f"(every sequence keeps a valid token)")
        if self.padding < 0:
            raise ValueError(f"TokenLoss.padding {self.padding}: needs >= 0 trailing positions")
        if self.ignore_index >= 0:
            raise ValueError(f"TokenLoss.ignore_index {self.ignore_index}: a negative value, never a class id")
        if self.loss_fn is not None and self.label_smoothing:
            raise ValueError("TokenLoss: label_smoothing applies to the built-in cross entropy; a loss_fn "
                             "smooths its own labels")

    @property
    def is_default(self) -> bool:
        """Plain cross entropy over every position: what a case without a `TokenLoss` computes."""
        return self == TokenLoss()

    def describe(self) -> str:
        """The fields that differ from the defaults, a loss function by its name (no address: a
        case's description is the same in every process)."""
        changed = [f"{f.name}={getattr(self.loss_fn, '__name__', 'loss_fn') if f.name == 'loss_fn' else getattr(self, f.name)}"
                   for f in fields(self) if getattr(self, f.name) != f.default]
        return f"TokenLoss({', '.join(changed)})"


def valid(loss: TokenLoss, labels: Tensor) -> Tensor:
    """bool, the labels' shape: True where the token carries loss."""
    return labels != loss.ignore_index


def valid_tokens(loss: TokenLoss, labels: Tensor) -> int:
    """How many label positions carry loss: the divisor of the token mean."""
    return int(valid(loss, labels).sum())


def token_losses(loss: TokenLoss, logits: Tensor, labels: Tensor, *, smoothing: Smoothing = "uniform") -> Tensor:
    """Per-token losses (the labels' shape), 0 at ignored positions, computed in the logits'
    dtype (the reference passes float64, or the framework's float32 island)."""
    if smoothing not in SMOOTHINGS:
        raise ValueError(f"smoothing {smoothing!r}: one of {list(SMOOTHINGS)}")
    keep = valid(loss, labels)
    safe = torch.where(keep, labels, torch.zeros_like(labels))
    if loss.loss_fn is not None:
        per = loss.loss_fn(logits, safe)
        if per.shape != labels.shape:
            raise ValueError(f"TokenLoss.loss_fn returned shape {tuple(per.shape)} for labels {tuple(labels.shape)}: "
                             f"one loss per token")
        return torch.where(keep, per, torch.zeros_like(per))
    flat = logits.reshape(-1, logits.shape[-1])
    eps = loss.label_smoothing
    if smoothing == "others" and eps:
        vocab = flat.shape[-1]
        # epsilon / (V - 1) on every other class: (1 - eps') nll + eps' mean(-log p), eps' = eps V / (V - 1)
        eps = eps * vocab / (vocab - 1)
        logp = torch.log_softmax(flat, dim=-1)
        nll = -logp.gather(-1, safe.reshape(-1, 1)).squeeze(-1)
        per = (1.0 - eps) * nll - eps * logp.mean(dim=-1)
    else:
        per = F.cross_entropy(flat, safe.reshape(-1), reduction="none", label_smoothing=eps)
    per = per.reshape(labels.shape)
    return torch.where(keep, per, torch.zeros_like(per))


def loss_sum(loss: TokenLoss, logits: Tensor, labels: Tensor, *, smoothing: Smoothing = "uniform") -> Tensor:
    """The token losses summed over the valid positions (`Case.loss_sum`'s shape)."""
    return token_losses(loss, logits, labels, smoothing=smoothing).sum()


def mask_labels(loss: TokenLoss, labels: Tensor, generator: torch.Generator) -> Tensor:
    """`labels` (rows, seq) with `ignore_index` at the last `padding` positions of every row and
    at floor(masked_fraction x unpadded positions) positions drawn per row among the rest: the
    same count in every row. Draws from `generator` only where something is masked, so a default
    `TokenLoss` leaves a case's batches as they were."""
    if labels.ndim != 2:
        raise ValueError(f"mask_labels: labels of shape (rows, seq), got {tuple(labels.shape)}")
    rows, seq = labels.shape
    open_ = seq - loss.padding
    if open_ < 1:
        raise ValueError(f"TokenLoss.padding {loss.padding} leaves no position of a {seq}-token sequence")
    out = labels.clone()
    out[:, open_:] = loss.ignore_index
    masked = int(loss.masked_fraction * open_)
    if masked:
        for r in range(rows):
            out[r, torch.randperm(open_, generator=generator)[:masked]] = loss.ignore_index
    return out


def pad_positions(loss: TokenLoss, rows: int, seq: int) -> Tensor:
    """bool (rows, seq): True at the trailing pad positions (a key-padding mask; each framework
    builds its own attention-mask form from it)."""
    pad = torch.zeros(rows, seq, dtype=torch.bool)
    if loss.padding:
        pad[:, seq - loss.padding:] = True
    return pad


__all__ = ["SMOOTHINGS", "Smoothing", "TokenLoss", "loss_sum", "mask_labels", "pad_positions", "token_losses",
           "valid", "valid_tokens"]
