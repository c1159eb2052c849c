"""Stage: capture. Which module of the sharded model is running now, in forward or in backward:
what a crash, an abort or a collective is placed in ("in blocks.0.attn.core (backward)"), where a
traceback names only autograd's engine or gloo's all-to-all.

The modules running come from `step.modules.ModuleStack` (hooks on this model's modules only;
backward tracked as torch's module tracker does: entered when its outputs' grads are ready, left
when its inputs' are), the phase from the caller (the rank's `CommCounter.phase`): outside forward
and backward (the grad sync, the optimizer) no module is running. An exception leaves the modules
it unwound through entered, which is what the failure reads. Names are the reference's (a
wrapper's prefix stripped), as the trace names them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from sp_harness.step.modules import ModuleStack


class ModuleWhere:
    """`with ModuleWhere(model, phase, prefix) as where:` `where.now()` is '<module> (<phase>)'
    for the innermost running module of `model`, '' for none."""

    def __init__(self, model: nn.Module, phase: Callable[[], str], prefix: str = ""):
        self.phase = phase
        self.prefix = prefix
        wrapper = prefix.rstrip(".")
        self.stack = ModuleStack(model, select=lambda name: bool(name) and name.startswith(prefix) and name != wrapper)

    def __enter__(self) -> ModuleWhere:
        self.stack.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stack.__exit__(*exc)

    def now(self) -> str:
        phase = self.phase()
        name = self.stack.innermost
        if name is None or phase not in ("forward", "backward"):
            return ""
        return f"{name[len(self.prefix):]} ({phase})"


__all__ = ["ModuleWhere"]
