"""Stage: checks (rank side). The three references of a side-by-side check, each computed once
per example.

The float64 reference, the run-precision reference and the perturbed float64 reference (see
sp_harness.compare.tolerance) are the same for every rank of a job: the global batch, the params
the sharded run holds (re-anchored each step). Each is computed on one rank only (`owner`: by
cost, to the least loaded rank) and broadcast (one pickled header, one flat float64 buffer, exact for every run dtype), so a job on W
ranks does each reference once instead of W times. The result is bit for bit what every rank
used to compute for itself: deterministic CPU code, the perturbed reference's generator drawn by
its owner alone, the order noise keyed on the op's inputs.

Localising a FAIL needs every reference's module trace on the failing rank: there, and only then,
the missing references are recomputed locally.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sp_harness.compare.tolerance import lp_dtype
from sp_harness.config.case import Batch, Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.step.build import Built
from sp_harness.step.reference import RefStep, reference_pass
from sp_harness.step.rounding import RoundingNoise, perturb_

KINDS = ("r64", "lp", "alt")
COST = {"alt": 3.0, "lp": 1.5, "r64": 1.0}
"""Relative cost of one pass: the perturbed reference rounds every op's inputs and result and adds
a worst-order summation error (an extra |A||B| matmul) in float64; the run-precision one adds that
error at its own precision; the float64 one is a plain pass."""


def owner(which: str, world_size: int) -> int:
    """The rank that computes reference `which`: the most expensive first, each to the least
    loaded rank (ties to the lowest), so at 2 ranks the perturbed reference runs alone."""
    load = [0.0] * world_size
    placed = {}
    for kind in sorted(KINDS, key=lambda k: -COST[k]):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        placed[kind] = rank
        load[rank] += COST[kind]
    return placed[which]


@dataclass(kw_only=True)
class References:
    """float64, the run's own precision, and float64 with every op's inputs and result perturbed."""

    r64: nn.Module
    lp: nn.Module
    alt: nn.Module
    alt_noise: RoundingNoise
    alt_gen: torch.Generator
    dtype: torch.dtype
    """The run dtype."""
    platform: contextlib.AbstractContextManager
    """The order-noise mode the run-precision reference runs under."""
    forward_only: bool = False
    """A forward-only check: the references skip backward (`reference_pass(backward=False)`)."""

    def model(self, which: str) -> nn.Module:
        return getattr(self, which)

    def params(self, which: str) -> dict[str, nn.Parameter]:
        return dict(self.model(which).named_parameters())

    def anchor(self, which: str, full: dict[str, torch.Tensor]) -> None:
        """Load the sharded run's current params (sp_harness.step.anchor) into one reference."""
        params = self.params(which)
        with torch.no_grad():
            for name, value in full.items():
                params[name].copy_(value)
                if which == "alt":
                    perturb_(params[name], torch.finfo(self.dtype).eps, self.alt_gen)

    def compute(self, which: str, case: Case, batch: Batch) -> RefStep:
        backward = not self.forward_only
        if which == "r64":
            return reference_pass(self.r64, case, batch, torch.float64, backward=backward)
        if which == "lp":
            with self.platform:
                return reference_pass(self.lp, case, batch, lp_dtype(self.dtype), backward=backward)
        return reference_pass(self.alt, case, batch, torch.float64, noise=self.alt_noise, backward=backward)

    def passes(self, full: dict[str, torch.Tensor], case: Case, batch: Batch) -> dict[str, RefStep]:
        """Every reference's step, each computed by its owner and shared with the others."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        steps = {}
        for which in KINDS:
            if owner(which, world_size) == rank:
                self.anchor(which, full)
                steps[which] = self.compute(which, case, batch)
        if world_size > 1:
            for which in KINDS:
                steps[which] = _share(steps.get(which), self.model(which), owner(which, world_size))
        return steps

    def recompute_missing(self, full: dict[str, torch.Tensor], case: Case, batch: Batch) -> None:
        """Run locally the references this rank does not own (their module traces, for localising)."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        for which in KINDS:
            if owner(which, world_size) != rank:
                grads = [p.grad for p in self.model(which).parameters()]
                for p in self.model(which).parameters():
                    p.grad = None  # backward accumulates: keep the shared grads out of it
                self.anchor(which, full)
                self.compute(which, case, batch)
                for p, g in zip(self.model(which).parameters(), grads, strict=True):
                    p.grad = g  # the shared grads stay the ones judged


def make_references(built: Built, config: CheckConfig, platform, matmul_input_rel: float | None) -> References:
    dtype = config.torch_dtype
    alt_gen = torch.Generator().manual_seed(config.seed + 104729)
    accumulator = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    # a run of float32 or less cannot hold what would overflow a float32 |A| @ |B|
    magnitude = torch.float32 if torch.finfo(dtype).bits <= 32 else None
    noise = RoundingNoise(torch.finfo(dtype).eps, alt_gen, torch.finfo(accumulator).eps, matmul_input_rel, magnitude)
    return References(r64=built.reference, lp=copy.deepcopy(built.reference).to(lp_dtype(dtype)),
                      alt=copy.deepcopy(built.reference), alt_noise=noise, alt_gen=alt_gen, dtype=dtype,
                      platform=platform, forward_only=bool(config.forward_only))


def _tensors(step: RefStep, model: nn.Module) -> list[torch.Tensor | None]:
    """A step's tensors in a fixed order: out, loss, out_grad, input grads (by name), attention
    log-sum-exps (by module name), param grads."""
    return ([step.out, step.loss, step.out_grad] + [step.input_grads[k] for k in sorted(step.input_grads)]
            + [step.lse[k] for k in sorted(step.lse)] + [p.grad for p in model.parameters()])


def _share(step: RefStep | None, model: nn.Module, src: int) -> RefStep:
    """Broadcast `src`'s reference step (and its model's param grads) to every rank."""
    device = next(model.parameters()).device
    if step is not None:
        tensors = _tensors(step, model)
        header = [(sorted(step.input_grads), sorted(step.lse),
                   [None if t is None else (tuple(t.shape), t.dtype) for t in tensors])]
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors if t is not None])
    else:
        header = [None]
    dist.broadcast_object_list(header, src=src, device=device if device.type == "cuda" else None)
    names, lse_names, metas = header[0]
    if step is None:
        flat = torch.empty(sum(_numel(m[0]) for m in metas if m is not None), dtype=torch.float64, device=device)
    dist.broadcast(flat, src=src)
    if step is not None:
        return step
    tensors, at = [], 0
    for meta in metas:
        if meta is None:
            tensors.append(None)
            continue
        shape, dtype = meta
        n = _numel(shape)
        tensors.append(flat[at:at + n].reshape(shape).to(dtype))
        at += n
    out, loss, out_grad = tensors[:3]
    at = 3 + len(names)
    grads = dict(zip(names, tensors[3:at], strict=True))
    lse = dict(zip(lse_names, tensors[at:at + len(lse_names)], strict=True))
    for p, g in zip(model.parameters(), tensors[at + len(lse_names):], strict=True):
        p.grad = g
    return RefStep(out=out, loss=loss, input_grads=grads, out_grad=out_grad, lse=lse)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
