"""Stage: step. "Your loss and your batch" on megatron-core (a `TokenLoss`, cases/frameworks/token_loss.py),
passed the way megatron users pass it:

- the batch: labels with `ignore_index` where the generated loss mask or the trailing padding
  says so; megatron gets `labels` holding a valid token id there and `loss_mask` (pretrain_gpt's
  data), and with padding an `attention_mask` ([b, 1, s, s] bool, True = masked: causal and the pad
  keys; megatron's softmax then builds no causal mask of its own);
- the loss: the per-token losses reduced by pretrain_gpt.py's loss function shape
  (`loss_func(loss_mask, output_tensor) -> (sum, num_tokens, report)`), then normalised as
  megatron's schedule normalises it: by the global valid-token count in `finalize_model_grads`
  (`calculate_per_token_loss=True`) or by the replica's own count (False);
- the per-token losses come from megatron's `vocab_parallel_cross_entropy` (its `label_smoothing`,
  the vocab-parallel logits), from the GPTModel itself (`model_loss`: called with `labels`, as
  pretrain_gpt's forward step calls it), or, on logits megatron gathered over TP
  (`vocab_parallel_loss=False`), from torch's cross entropy or the user's `loss_fn`.

The reference computes the same loss from the TP=1 model's logits with token_loss's functions:
in float64, or in float32 where megatron's vocab-parallel cross entropy keeps its float32 island.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from sp_harness.cases.frameworks.token_loss import TokenLoss, mask_labels, pad_positions, token_losses, valid

SmoothingStats = Literal["megatron", "global"]
"""Where the vocab-parallel loss takes label smoothing's statistics from: 'megatron' is
megatron-core's own `vocab_parallel_cross_entropy(label_smoothing=)`, whose mean log-probability
and vocabulary size are the local shard's (wrong at TP > 1 in 0.16.1: Megatron-LM #7452 finding 1,
#7464, #737); 'global' is the fix proposed upstream (#7466): megatron's cross entropy for the target
term, the mean log-probability over the whole vocabulary from TP-reduced sums."""
SMOOTHING_STATS: tuple[SmoothingStats, ...] = ("megatron", "global")


def check_loss(name: str, loss: TokenLoss, *, vocab_parallel_loss: bool, model_loss: bool,
               smoothing: SmoothingStats) -> None:
    """The loss settings megatron can express, checked when the case is made."""
    where = f"megatron_case({name!r})"
    if smoothing not in SMOOTHING_STATS:
        raise ValueError(f"{where}: smoothing {smoothing!r}; valid: {list(SMOOTHING_STATS)}")
    if model_loss and (loss.label_smoothing or loss.loss_fn is not None):
        raise ValueError(f"{where}: model_loss=True is the GPTModel's own cross entropy (compute_language_model_loss), "
                         f"which has no label smoothing ({loss.label_smoothing}) and no user loss function")
    if loss.loss_fn is not None and vocab_parallel_loss:
        raise ValueError(f"{where}: a loss_fn of (logits, labels) needs the whole vocabulary on each rank: "
                         f"set vocab_parallel_loss=False (megatron gathers the logits over TP, parallel_output=False)")


def loss_func(loss_mask: Tensor, output_tensor: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """pretrain_gpt.py's loss function: the local loss sum over `loss_mask`, the local valid-token
    count and the report the training loop logs. Its `.float()` lifts 16-bit losses to float32;
    a float64 run (which megatron never trains) keeps float64."""
    dtype = torch.promote_types(output_tensor.dtype, torch.float32)
    losses = output_tensor.reshape(-1).to(dtype)
    mask = loss_mask.reshape(-1).to(dtype)
    total = torch.sum(losses * mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([total.clone().detach().view(1), num_tokens.view(1).to(dtype)])
    return total, num_tokens, {"lm loss": report}


def global_smoothing_cross_entropy(logits: Tensor, labels: Tensor, eps: float, group: dist.ProcessGroup) -> Tensor:
    """Vocab-parallel cross entropy with label smoothing over the whole vocabulary (#7466's fix):
    megatron's `vocab_parallel_cross_entropy` for the target term; the mean of -log p over all
    V = local V x TP classes as logsumexp - sum(logits) / V, both sums reduced over `group`
    (forward all-reduce, backward identity: each rank's loss is the whole loss, as megatron's own
    cross entropy backpropagates its local slice only)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    x = logits.float()
    vocab = x.shape[-1] * dist.get_world_size(group)
    peak = x.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    lse = torch.log(reduce(torch.exp(x - peak).sum(dim=-1), group)) + peak.squeeze(-1)
    mean_neg_logp = lse - reduce(x.sum(dim=-1), group) / vocab
    nll = vocab_parallel_cross_entropy(logits.clone(), labels)  # megatron's: it overwrites its input in place
    smoothing = eps * vocab / (vocab - 1)  # megatron's convention: eps spread over the V - 1 other classes
    return (1.0 - smoothing) * nll + smoothing * mean_neg_logp


PerTokenLosses = Callable[[Tensor, Tensor, dist.ProcessGroup], Tensor]
"""(the model's output, labels holding valid ids, the TP group) -> per-token losses."""


def per_token_losses(loss: TokenLoss, *, vocab_parallel_loss: bool, model_loss: bool,
                     smoothing: SmoothingStats) -> PerTokenLosses:
    """The sharded twin's per-token losses from its output (vocab-parallel or gathered logits,
    or the GPTModel's own losses) and labels holding valid ids."""

    def losses(out: Tensor, labels: Tensor, tp_group: dist.ProcessGroup) -> Tensor:
        if model_loss:
            return out  # the GPTModel called with labels returned them
        if not vocab_parallel_loss:  # the whole vocabulary on every rank: torch's or the user's loss
            return token_losses(loss, out, labels, smoothing="uniform")
        if loss.label_smoothing and smoothing == "global":
            return global_smoothing_cross_entropy(out, labels, loss.label_smoothing, tp_group)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(out, labels, label_smoothing=loss.label_smoothing)

    return losses


class ShardedLoss:
    """The sharded twin's `local_loss` and the token count its `finalize_model_grads` is given."""

    def __init__(self, loss: TokenLoss, *, per_token: bool, losses: Callable[[Tensor, Tensor, dist.ProcessGroup], Tensor]):
        self.loss, self.per_token, self.losses = loss, per_token, losses
        self.num_tokens: Tensor | None = None

    def __call__(self, out: Tensor, tgt: Tensor, ctx) -> Tensor:
        loss_mask = valid(self.loss, tgt)
        labels = torch.where(loss_mask, tgt, torch.zeros_like(tgt))
        total, num_tokens, _ = loss_func(loss_mask, self.losses(out, labels, ctx.tp_group))
        if not self.per_token:
            # megatron's schedule without calculate_per_token_loss: the replica's sum / its own count;
            # its DDP then averages the grads over DP
            self.num_tokens = None
            return total / num_tokens
        # calculate_per_token_loss: backward starts from the replica's sum, finalize_model_grads
        # all-reduces num_tokens over DP and divides the grads by it. The engine reads each
        # replica's share of the global token mean (it averages the shares over DP): that value,
        # with the sum's grad
        # megatron's count is an int tensor, so finalize's 1.0 / count is a float32 scalar: a float64
        # loss (a float64 run off megatron's float32 cross entropy: gathered logits, a user loss)
        # gets the same count as a float64 tensor, or its grads would round at float32's eps
        self.num_tokens = num_tokens.to(total.dtype) if total.dtype == torch.float64 else num_tokens
        count = num_tokens.to(total.dtype)
        if ctx.dp > 1:
            dist.all_reduce(count, group=ctx.dp_group)
        share = total.detach() * ctx.dp / count
        # exactly the share's value (x - x is 0), the sum's grad; share + (total - share) would
        # round the value at the sum's ulp
        return share + (total - total.detach())


def reference_loss_sum(loss: TokenLoss, *, vocab_parallel_loss: bool,
                       model_loss: bool) -> Callable[[Tensor, Tensor], Tensor]:
    """The references' summed token loss (`Case.loss_sum`) from the TP=1 model's output: its
    logits, or (`model_loss`) the per-token losses `reference_language_model_loss` made. Where the
    sharded twin uses megatron's vocab-parallel cross entropy, which computes in float32 whatever
    the logits' dtype, the references compute it in float32 too, so the island is on both sides."""

    def loss_sum(out: Tensor, tgt: Tensor) -> Tensor:
        if model_loss:
            return (out * valid(loss, tgt).to(out.dtype)).sum()
        if vocab_parallel_loss:
            logits = out.float() if torch.finfo(out.dtype).bits > 32 else out
            return token_losses(loss, logits, tgt, smoothing="others").sum()
        return token_losses(loss, out, tgt, smoothing="uniform").sum()

    return loss_sum


def reference_language_model_loss(gpt: torch.nn.Module) -> None:
    """The TP=1 reference called with labels computes its per-token losses in float32 (megatron's
    island) with torch's cross entropy, not megatron's `vocab_parallel_cross_entropy`: that reads
    megatron's global TP group (0.16.1 takes no group there), which is the sharded twin's, not the
    reference's one-rank group."""

    def compute_language_model_loss(labels: Tensor, logits: Tensor) -> Tensor:  # logits [s, b, V]
        flat = logits.float().transpose(0, 1)
        return torch.nn.functional.cross_entropy(flat.reshape(-1, flat.shape[-1]), labels.reshape(-1),
                                                 reduction="none").reshape(labels.shape)

    # an instance attribute: torch types a module's attributes as Tensor | Module
    setattr(gpt, "compute_language_model_loss", compute_language_model_loss)  # noqa: B010


def make_inputs(loss: TokenLoss, tokens: Tensor, labels: Tensor, gen: torch.Generator,
                *, model_loss: bool) -> tuple[dict[str, Tensor | None], Tensor]:
    """The batch's extra inputs (attention mask, labels for the model) and its target (labels
    with `ignore_index` where no loss is owed)."""
    rows, seq = labels.shape
    target = mask_labels(loss, labels, gen)
    extra: dict[str, Tensor | None] = {"attention_mask": None}
    if loss.padding:
        pad = pad_positions(loss, rows, seq)
        tokens.masked_fill_(pad, 0)  # a tokenizer's pad id; no position attends to it
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
        extra["attention_mask"] = (causal | pad[:, None, :])[:, None]  # [b, 1, s, s], True = masked
    if model_loss:
        extra["labels"] = torch.where(valid(loss, target), target, torch.zeros_like(target))
    return extra, target


__all__ = ["SMOOTHING_STATS", "PerTokenLosses", "ShardedLoss", "SmoothingStats", "check_loss", "global_smoothing_cross_entropy",
           "loss_func", "make_inputs", "per_token_losses", "reference_language_model_loss", "reference_loss_sum"]
