"""Stage: step. Rank side: one forward + backward of a reference model on the whole batch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from sp_harness.config.case import Batch, Case
from sp_harness.step.inputs import call
from sp_harness.step.rounding import RoundingNoise, perturb_


@dataclass(kw_only=True)
class RefStep:
    """One reference forward + backward."""

    out: torch.Tensor
    loss: torch.Tensor
    input_grads: dict[str, torch.Tensor]
    """d loss / d input for each floating input, by name."""
    out_grad: torch.Tensor | None
    """d loss / d output: what the loss's error bound propagates the output's error through."""
    lse: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each attention module's per-query log-sum-exp (B, a, S), by module name (reference.gpt)."""


def reference_pass(model: nn.Module, case: Case, batch: Batch, dtype: torch.dtype,
                   noise: RoundingNoise | None = None, *, backward: bool = True) -> RefStep:
    """Forward and backward of `model` on the global batch in `dtype`; with `noise`, every op's
    inputs and result carry that rounding (the perturbed reference). `backward=False` (a
    forward-only check): no param or input grads, only d loss / d output, through the loss alone
    (the loss's error allowance needs it)."""
    inputs = {}
    for name, t in batch.inputs.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.to(dtype)
            if noise is not None:
                t = perturb_(t.clone(), noise.rel, noise.gen)
            t = t.detach().requires_grad_(True)
        inputs[name] = t
    tgt = batch.target.to(dtype) if batch.target.is_floating_point() else batch.target
    # the case's declared precision islands are modelled by the perturbed reference only
    islands = noise.islands(model, case.precision_islands) if noise is not None else contextlib.nullcontext()
    with noise if noise is not None else contextlib.nullcontext(), islands:
        out = call(model, inputs, batch.positional)
        if out.requires_grad:
            out.retain_grad()
        loss = case.loss_sum(out, tgt) / case.tokens(tgt)
        if backward:
            loss.backward()
            out_grad = out.grad
        else:
            out_grad = torch.autograd.grad(loss, out)[0] if out.requires_grad else None
    # each floating input is a grad leaf the loss depends on: backward gave it a grad
    grads = cast(dict[str, torch.Tensor], {name: t.grad for name, t in inputs.items()
                                           if backward and isinstance(t, torch.Tensor) and t.is_floating_point()})
    lse = {name: m.lse for name, m in model.named_modules() if isinstance(getattr(m, "lse", None), torch.Tensor)}
    return RefStep(out=out.detach(), loss=loss.detach(), input_grads=grads, out_grad=out_grad, lse=lse)
