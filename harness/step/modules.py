"""Stage: step. Which of a model's modules is running, in its forward and in its backward.

A dispatch mode sees ops, not modules. `ModuleStack` puts hooks on one model's modules (not the
process-wide module hooks torch.utils.module_tracker uses: the other models of a check run in
the same process) and keeps the names of those running, for the perturbed
reference's declared precision islands (sp_harness.step.rounding) and the island observer
(sp_harness.capture.islands).

Backward is tracked the way torch.utils.module_tracker does it: a module is entered when the
grads of all its outputs are ready and left when those of its inputs are. That is approximate: a
module whose inputs need no grad is left only when the stack closes, and the autograd engine may
run another branch's ops in between. Both only widen what counts as inside.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten


class ModuleStack:
    """`with ModuleStack(model, select) as stack:` `stack.active` names the selected modules
    running now (named as in `model.named_modules()`), in the order they were entered;
    `innermost` the deepest of them. `on_change()` is called after every entry and exit."""

    def __init__(self, model: nn.Module, select: Callable[[str], bool] = lambda name: True,
                 on_change: Callable[[], None] = lambda: None):
        self.model, self.select, self.on_change = model, select, on_change
        self.active: list[str] = []
        self._handles: list = []

    @property
    def innermost(self) -> str | None:
        """The deepest running module by name (the order of `active` is entry order, which in
        backward is not nesting order: a module and its parent can start theirs on one grad)."""
        if not self.active:
            return None
        return max(reversed(self.active), key=lambda name: name.count(".") + bool(name))

    def __enter__(self) -> ModuleStack:
        for name, module in self.model.named_modules():
            if self.select(name):
                self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.active:
            self.active.clear()
            self.on_change()

    def _enter(self, name: str) -> None:
        self.active.append(name)
        self.on_change()

    def _leave(self, name: str) -> None:
        for i in range(len(self.active) - 1, -1, -1):
            if self.active[i] == name:
                del self.active[i]
                self.on_change()
                return

    def _on_grads(self, values, action: Callable[[str], None], name: str) -> None:
        tensors = [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self._handles.append(register_multi_grad_hook(tensors, lambda grads: action(name)))

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            self._enter(name)
            self._on_grads((args, kwargs), self._leave, name)  # its inputs' grads: its backward is done
        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            self._leave(name)
            self._on_grads(output, self._enter, name)  # its outputs' grads: its backward begins
        return hook
