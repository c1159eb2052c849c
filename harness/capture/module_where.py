"""Stage: capture. Which module of the sharded model is running now, in forward or in backward:
what a crash, an abort or a collective is placed in ("in blocks.0.attn.core (backward)"), where a
traceback names only autograd's engine or gloo's all-to-all.

Forward: a module is entered at its forward pre-hook and left at its forward hook; an exception
leaves it entered, which is what the failure reads. Backward: a module is entered when the grad
of its output arrives (a hook on the output tensor) and left when the grad of its input does (a
hook on the input tensor); a module whose input takes no grad (an embedding of token ids) stays
entered until the pass ends, which is right for the last module backward reaches. Each pass
starts empty (`clear`). Only the sharded model is hooked; names are the reference's (a wrapper's
prefix stripped), as the trace names them.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from sp_harness.capture.trace import first_input


class ModuleWhere:
    """The innermost running module of one model and its phase."""

    def __init__(self, model: nn.Module, prefix: str = ""):
        self._stack: list[tuple[str, str]] = []
        # autograd may run a module's backward hooks on a device thread
        self._lock = threading.Lock()
        self._handles = []
        for name, module in model.named_modules():
            if not name or not name.startswith(prefix) or name == prefix.rstrip("."):
                continue
            name = name[len(prefix):]
            self._handles.append(module.register_forward_pre_hook(self._enter(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave(name)))

    def now(self) -> str:
        """'<module> (<phase>)' for the innermost running module, '' for none."""
        with self._lock:
            if not self._stack:
                return ""
            name, phase = self._stack[-1]
        return f"{name} ({phase})"

    def clear(self) -> None:
        with self._lock:
            self._stack.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _push(self, name: str, phase: str) -> None:
        with self._lock:
            self._stack.append((name, phase))

    def _pop(self, name: str, phase: str) -> None:
        with self._lock:
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i] == (name, phase):
                    del self._stack[i]
                    return

    def _enter(self, name: str):
        def hook(module, args, kwargs):
            x = first_input(args, kwargs)
            if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
                # its input's grad arriving is the end of the module's backward
                x.register_hook(lambda grad: self._pop(name, "backward"))
            self._push(name, "forward")
        return hook

    def _leave(self, name: str):
        def hook(module, args, output):
            self._pop(name, "forward")
            out = output[0] if isinstance(output, tuple | list) and output else output
            if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
                # its output's grad arriving is the start of the module's backward
                out.register_hook(lambda grad: self._push(name, "backward"))
        return hook


__all__ = ["ModuleWhere"]
