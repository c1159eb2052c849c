"""Stage: capture -> compare. The differential trace: which module diverged first.

Forward hooks record every module's output on both sides (the sharded model and the three
references), keyed by the module's qualified name; a hook on each module's first input tensor
records its grad (the total grad of that tensor, the same on both sides). When a step fails, its modules are compared in execution
order (forward), then in backward's order, with the same tolerance model as the final output,
and the first one out of its bound is named: whoever reads the verdict knows which layer to
open.

A module is compared where the two sides can be lined up without knowing the case: same
qualified name, no TP-sharded parameter of its own (a column- or row-parallel linear returns a
piece or a partial sum, and its input grad is partial until the next collective), and the
sharded tensor is either the reference's whole tensor or its slice of
the sequence (a dim whose reference size is seq_len and whose local size is this rank's shard).
Column-parallel pieces and DTensors are skipped. Hooks only keep references to tensors the
step computes anyway, so a passing step costs a dict insert per module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sp_harness.compare.tolerance import check_tensor
from sp_harness.config import shards as sh


@dataclass(kw_only=True)
class Divergence:
    step: int
    rank: int
    phase: str
    """'forward' (the module's output), 'backward' (its input grad), or 'none' (every traced
    module agrees: the error is in the param grads or their sync)."""
    module: str
    ratio: float
    """max |error| / allowed at this module."""
    order: int = 0
    """Position in its phase's execution order (for picking the earliest across ranks)."""

    def sort_key(self):
        return (self.step, ("forward", "backward", "none").index(self.phase), self.order, self.rank)

    def describe(self) -> str:
        if self.phase == "none":
            return (f"every traced module's output and input grad is within its bound at step {self.step} "
                    f"(rank {self.rank}): the error enters after backward, in the grad sync or the param grads")
        what = "output" if self.phase == "forward" else "input grad"
        return (f"first diverging module: {self.module} ({what}, {self.phase}, step {self.step}, rank {self.rank}, "
                f"{self.ratio:.3g}x its bound)")


class Recorder:
    """Module outputs and input grads of one model, in the order they happened."""

    def __init__(self, model: nn.Module, skip: frozenset[str] = frozenset()):
        self.forward: dict[str, torch.Tensor] = {}
        self.backward: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, module in model.named_modules():
            if not name or name in skip:
                continue
            self._handles.append(module.register_forward_hook(self._on_forward(name)))
            self._handles.append(module.register_forward_pre_hook(self._on_input(name)))

    def _on_forward(self, name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and type(output) is torch.Tensor and output.is_floating_point():
                self.forward.setdefault(name, output.detach())
        return hook

    def _on_input(self, name):
        # a hook on the input tensor, not a full backward hook: those wrap the module's inputs
        # and outputs in an autograd Function, which in-place modules (ReLU(inplace=True)) reject,
        # and the trace must never make a correct model fail
        def hook(module, args):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and type(x) is torch.Tensor and x.requires_grad:
                x.register_hook(self._grad_hook(name))
        return hook

    def _grad_hook(self, name):
        def hook(grad):
            self.backward.setdefault(name, grad.detach())  # returns None: the grad is unchanged
        return hook

    def clear(self) -> None:
        self.forward.clear()
        self.backward.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _line_up(got: torch.Tensor, ref: torch.Tensor, seq_len: int, seq_shards, tp_rank: int):
    """`ref` cut to `got`'s piece (whole, or this rank's slice of a sequence dim), or None."""
    if got.shape == ref.shape:
        return lambda t: t
    if got.dim() != ref.dim():
        return None
    for dim in range(ref.dim()):
        if ref.shape[dim] == seq_len and got.shape[dim] == seq_shards[tp_rank] and all(
                got.shape[d] == ref.shape[d] for d in range(ref.dim()) if d != dim):
            return lambda t, dim=dim: sh.shard(t, dim, seq_shards, tp_rank)
    return None


def first_divergence(*, step: int, rank: int, sharded: Recorder, ref64: Recorder, ref_lp: Recorder,
                     ref_alt: Recorder, dtype: torch.dtype, seq_len: int, seq_shards, tp_rank: int
                     ) -> Divergence:
    for phase in ("forward", "backward"):
        got_side = getattr(sharded, phase)
        for order, (name, got) in enumerate(got_side.items()):
            want = getattr(ref64, phase).get(name)
            want_lp = getattr(ref_lp, phase).get(name)
            want_alt = getattr(ref_alt, phase).get(name)
            if want is None or want_lp is None:
                continue
            cut = _line_up(got, want, seq_len, seq_shards, tp_rank)
            if cut is None:
                continue
            chk = check_tensor(kind=phase, name=name, step=step, rank=rank, got=got, ref64=cut(want),
                               ref_lp=cut(want_lp), dtype=dtype,
                               ref_alt=None if want_alt is None else cut(want_alt))
            if not chk.ok:
                return Divergence(step=step, rank=rank, phase=phase, module=name, ratio=chk.ratio, order=order)
    return Divergence(step=step, rank=rank, phase="none", module="", ratio=0.0)
