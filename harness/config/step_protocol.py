"""Stage: config. The training-step protocol: a case's own step (loss normalisation, gradient
accumulation, grad sync, clipping, optimizer), verified against the loss it says it means.

The side-by-side check runs the engine's step around the sharded model. The silent training bugs
of 2024-2026 (micro-batch means averaged, middle micro-batches dropped, losses normalised by a
rank's own token count, a param missing from the clip norm) live in the step the engine replaces,
so a case that declares `Case.train_loss` hands its own step to the engine as
`Sharded.train_step`, and the training-step check (sp_harness.checks.train_step) judges what it
reports and what it leaves behind at each stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

Reduction = Literal["token-mean", "sum"]
REDUCTIONS: tuple[str, ...] = ("token-mean", "sum")


@dataclass(kw_only=True, frozen=True)
class TrainLoss:
    """The loss a case's training step means, as data: the engine computes it in float64 on one
    device over the whole global batch (every micro-batch of every rank) and judges the step's
    reported loss, its grads, its grad norm and its update against it."""

    reduction: Reduction = "token-mean"
    """'token-mean': the case's token-loss sum (`Case.loss_sum`) over every valid token of the
    global batch, divided by their count (`Case.tokens`), whatever the micro-batch and rank split;
    'sum': that sum undivided."""
    ignore_index: int = -100
    """The target value that marks a token with no loss (a pad, a prompt): the engine writes it
    where its drawn masks say a token is not valid, and `Case.tokens` must not count it."""

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"TrainLoss.reduction {self.reduction!r} is not one of {', '.join(REDUCTIONS)}")


@dataclass(kw_only=True, frozen=True)
class MicroBatch:
    """This rank's pieces of one micro-batch of the global batch."""

    inputs: Mapping[str, Any]
    """What the sharded module is called with (`call`): this rank's input pieces."""
    target: torch.Tensor
    """This rank's piece of the labels, cut like the output; `TrainLoss.ignore_index` where no
    loss is owed."""
    valid: torch.Tensor
    """bool, the target's shape: True where the token carries loss."""
    positional: bool = False
    """The case's batch is the `(input, target)` short form: the module takes its one input
    positionally (`call` does it either way)."""

    def call(self, module: torch.nn.Module) -> Any:
        """`module` on this micro-batch's inputs, as the engine calls the sharded module."""
        return module(*self.inputs.values()) if self.positional else module(**self.inputs)


@runtime_checkable
class TrainStep(Protocol):
    """A case's own training step, in three parts the engine calls in order, once per optimizer
    step, so it can read the grads between them. Write it as the framework does: the engine only
    observes."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer `step` steps, where it is a torch optimizer over the model's own params
        (sp_harness.step.optim_ref.make_optimizer): the engine reads its state to judge the update.
        None where its state cannot be read per param (fp32 master weights, ZeRO or
        distributed-optimizer partitions, a framework's wrapped optimizer): the engine then judges the
        update against a float64 shadow of the config's optimizer driven by the step's own grads
        (sp_harness.step.shadow), so the step must build its optimizer with optim_ref's
        hyper-parameters (SGD momentum 0.9; AdamW betas, eps and weight decay on every param) and keep
        its master copies and state in float32 (float64 in a float64 run)."""

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> float | torch.Tensor:
        """Forward and backward over this rank's micro-batches, the loss normalisation, the
        accumulation and the grad sync or finalize: afterwards the declared grads
        (`Sharded.grad_attr`) are the global batch's, before clipping. Returns the loss it reports
        (what a user logs), the same on every rank."""

    def grad_norm(self) -> float | torch.Tensor | None:
        """The global grad norm as this step's clipping computes it from the grads now in place,
        changing nothing: the engine calls it with all but one param's grads zeroed (in the
        tensors `grad_of` returns) to learn which params, and how many times each, the norm
        counts. None where the framework computes its norm only inside its step (DeepSpeed's
        engine): the norm `step` reports is still judged. A collective: every rank calls it."""

    def step(self) -> float | torch.Tensor:
        """Clip (where `CheckConfig.clip_grad_norm` is set), step the optimizer and zero the grads.
        Returns the grad norm it reports, before clipping."""


def grad_reader(step: TrainStep) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """The step's optional `grad_of(param)`: the grad of one local param (an entry of the sharded
    module's `named_parameters()`) as the framework holds it after `accumulate`, before clipping,
    shaped like that param, in any float dtype (megatron's live `main_grad`; a ZeRO partition
    gathered by `deepspeed.utils.safe_get_full_grad`). None: the engine reads `Sharded.grad_attr`.
    A step may also offer `zero_grad()`, which drops the accumulated grads without stepping (the
    invariance checks run a second accumulation from the same params; without it they zero
    `.grad` and the declared grads), `fixed_micro_batches = True` where its micro-batch count is
    fixed when it is built (DeepSpeed's gradient_accumulation_steps: accumulation-invariance is
    then UNSUPPORTED), and `set_lr(lr)`, which converge calls to follow its lr schedule where
    `optimizer` is None."""
    return getattr(step, "grad_of", None)


__all__ = ["MicroBatch", "REDUCTIONS", "Reduction", "TrainLoss", "TrainStep", "grad_reader"]
