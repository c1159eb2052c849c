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
                   noise: RoundingNoise | None = None, *, backward: bool = True,
                   terms: LinearTerms | None = None) -> RefStep:
    """Forward and backward of `model` on the global batch in `dtype`; with `noise`, every op's
    inputs and result carry that rounding (the perturbed reference). `backward=False` (a
    forward-only check): no param or input grads, only d loss / d output, through the loss alone
    (the loss's error allowance needs it). `terms`: a LinearTerms of `model` to record every
    nn.Linear's per-token terms in."""
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
    with noise if noise is not None else contextlib.nullcontext(), islands, terms or contextlib.nullcontext():
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


class LinearTerms:
    """Every nn.Linear's input and output grad per token while entered: its weight grad is one
    outer product g_t x_t^T per token, and how many independent directions its error spans (a
    gated unit, inputs that share a direction) depends on them. Every elementwise-affine norm's
    (a module whose class name has "Norm" and whose `weight` is 1-D: LayerNorm, RMSNorm, a
    framework's fused ones) normalised input x^_t = (y_t - bias) / weight and output grad: its
    weight grad is sum_t dy_t * x^_t, elementwise."""

    def __init__(self, model: nn.Module):
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.norms = {name: m for name, m in model.named_modules()
                      if "Norm" in type(m).__name__ and isinstance(getattr(m, "weight", None), torch.Tensor)
                      and m.weight.dim() == 1}
        attention = [name for name, m in model.named_modules() if name and "Attention" in type(m).__name__]
        self.in_attention = {name for name in self.linears
                             if any(name.startswith(prefix + ".") for prefix in attention)}
        """Linears inside a module whose class name has "Attention" (q/k/v and output
        projections): their per-token terms come through the attention's token mixing, which a
        sharded run computes in other orders and blocks than any reference (tolerance.NO_CANCELLATION)."""
        self.inputs: dict[str, list[torch.Tensor]] = {name: [] for name in (*self.linears, *self.norms)}
        self.out_grads: dict[str, dict[int, torch.Tensor]] = {name: {} for name in self.inputs}
        self.handles: list = []

    def clear(self) -> None:
        for name in self.inputs:
            self.inputs[name], self.out_grads[name] = [], {}

    def __enter__(self) -> LinearTerms:
        self.clear()
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in (*self.linears.items(), *self.norms.items())]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, name: str):
        def forward_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
                return
            x = args[0].detach() if name in self.linears else _normalised(module, out.detach())
            calls = self.inputs[name]
            calls.append(x.reshape(-1, x.shape[-1]))
            if out.requires_grad:
                grads, call = self.out_grads[name], len(calls) - 1
                out.register_hook(lambda g: grads.__setitem__(call, g.detach().reshape(-1, g.shape[-1])))
        return forward_hook

    def terms(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(inputs (T, in), output grads (T, out)) per module name, every call's tokens in call
        order, for each module that got an output grad at every call (a norm's inputs: its
        normalised ones, `norms` names them)."""
        inputs, out_grads = {}, {}
        for name, calls in self.inputs.items():
            grads = self.out_grads[name]
            if calls and len(grads) == len(calls):
                inputs[name] = torch.cat(calls)
                out_grads[name] = torch.cat([grads[i] for i in range(len(calls))])
        return inputs, out_grads


def _normalised(norm: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """An elementwise-affine norm's x^ from its output y = x^ * weight + bias (0 where weight is)."""
    weight = cast(torch.Tensor, norm.weight).detach()
    bias = getattr(norm, "bias", None)
    if isinstance(bias, torch.Tensor):
        y = y - bias.detach()
    return torch.where(weight != 0, y / torch.where(weight != 0, weight, torch.ones_like(weight)), torch.zeros_like(y))
