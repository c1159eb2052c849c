"""Stage: capture. The differential trace: which module diverged first.

Forward hooks record every module's output on both sides (the sharded model and the three
references), keyed by the module's qualified name; a hook on each module's first input tensor
(its first positional argument, else its first keyword tensor: HF attention takes
`hidden_states=`) records its grad (the total grad of that tensor, the same on both sides). A
module whose input needed a grad that never came is noted too (`Trace.inputs`): where the
reference's grad is not zero, a detached exchange left it with none. When a step fails, its modules are compared in execution
order (forward), then in backward's order, with the same tolerance model as the final output,
and the first one out of its bound is named: whoever reads the verdict knows which layer to
open.

A module is compared where the two sides can be lined up without knowing the case: same
qualified name, no TP-sharded parameter of its own (a column- or row-parallel linear returns a
piece or a partial sum, and its input grad is partial until the next collective; a DTensor
output with no Partial placement says what its piece is and is compared), and the
sharded tensor is either the reference's whole tensor or its slice of
the sequence (a dim whose reference size is seq_len and whose local size is this rank's shard).
A DTensor output or input grad is recorded as its local piece where no placement is Partial
(a Replicate one is the whole tensor, a Shard on the sequence dim this rank's slice, which line
up as a plain tensor's would); a Partial one is a partial sum and is skipped, as are
column-parallel pieces (they line up with nothing and are named as such). A module returning a
tuple or list is recorded by its first element (megatron's (output, bias) convention). Hooks only keep
references to tensors the step computes anyway, so a passing step costs a dict insert per module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def traceable(t) -> bool:
    """Whether the trace keeps `t`: a plain floating tensor, or a floating DTensor none of whose
    placements is Partial."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return False
    return type(t) is torch.Tensor or (isinstance(t, DTensor) and not any(p.is_partial() for p in t.placements))


def comparable(t) -> torch.Tensor | None:
    """`t` as the trace keeps it (`traceable`): a plain tensor itself, a DTensor's local piece (no
    collective: the piece this rank holds), else None."""
    if not traceable(t):
        return None
    return t.to_local().detach() if isinstance(t, DTensor) else t.detach()


def first_input(args: tuple, kwargs: dict):
    """The input whose grad the trace records: the first positional argument, else (none given)
    the first keyword argument that is a tensor, where it is `traceable`; else None."""
    if args:
        x = args[0]
    else:
        x = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    return x if traceable(x) else None


@dataclass(kw_only=True)
class Trace:
    """One pass's module outputs and input grads, by module name, in the order they happened
    (what a Recorder held; it crosses processes where a Recorder's hooks cannot)."""

    forward: dict[str, torch.Tensor] = field(default_factory=dict)
    backward: dict[str, torch.Tensor] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    """Every module's name in the order its forward started, the skipped ones included: what
    ran before a diverging module, to name what could not be compared upstream of it."""
    inputs: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    """Every traced module whose input needed a grad, with that input's (local) shape and dtype."""
    reached: set[str] = field(default_factory=set)
    """The modules of `inputs` whose input got a grad, kept or not (a Partial DTensor's is not):
    one of `inputs` missing here got no grad at all (zero, for the comparison)."""


class Recorder:
    """Module outputs and input grads of one model, in the order they happened."""

    def __init__(self, model: nn.Module, skip: frozenset[str] = frozenset(), prefix: str = "",
                 outputs_only: frozenset[str] = frozenset()):
        """`skip`: module names (as `model` names them) left out, but for an output that is a
        DTensor with no Partial placement (its placements say what its local piece is, whatever
        params the module holds: torchtitan's vocab-parallel embedding); `outputs_only`: module
        names whose output is traced, skipped or not, and never their input grad
        (`Sharded.whole_outputs`); `prefix`: what a wrapper (DDP,
        megatron's Float16Module, DeepSpeed's engine: "module.") adds before the names the
        reference has: stripped, and the wrapper itself left out, so the modules line up."""
        self.forward: dict[str, torch.Tensor] = {}
        self.backward: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.inputs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.reached: set[str] = set()
        self._started: set[str] = set()
        self._handles = []
        for name, module in model.named_modules():
            if not name or not name.startswith(prefix) or name == prefix.rstrip("."):
                continue
            whole = name in outputs_only
            traced = name not in skip and not whole
            name = name[len(prefix):]
            self._handles.append(module.register_forward_pre_hook(self._on_start(name)))
            self._handles.append(module.register_forward_hook(self._on_forward(name, dtensor_only=not (traced or whole))))
            if traced:
                self._handles.append(module.register_forward_pre_hook(self._on_input(name), with_kwargs=True))

    def _on_start(self, name):
        def hook(module, args):
            if name not in self._started:
                self._started.add(name)
                self.order.append(name)
        return hook

    def _on_forward(self, name, dtensor_only: bool = False):
        def hook(module, args, output):
            # megatron's layers return (output, bias) and its transformer layer (output, context):
            # the first tensor is the output, on the reference (the same module class) too
            if isinstance(output, tuple | list) and output:
                output = output[0]
            if dtensor_only and not isinstance(output, DTensor):
                return
            local = comparable(output)
            if local is not None:
                self.forward.setdefault(name, local)
        return hook

    def _on_input(self, name):
        # a hook on the input tensor, not a full backward hook: those wrap the module's inputs
        # and outputs in an autograd Function, which in-place modules (ReLU(inplace=True)) reject,
        # and the trace must never make a correct model fail
        def hook(module, args, kwargs):
            x = first_input(args, kwargs)
            if x is not None and x.requires_grad:
                x.register_hook(self._grad_hook(name))
                local = x.to_local() if isinstance(x, DTensor) else x
                self.inputs.setdefault(name, (tuple(local.shape), local.dtype))
        return hook

    def _grad_hook(self, name):
        def hook(grad):
            self.reached.add(name)
            local = comparable(grad)
            if local is not None:
                self.backward.setdefault(name, local)
            # returns None: the grad is unchanged
        return hook

    def clear(self) -> None:
        self.inputs.clear()
        self.reached.clear()
        self.forward.clear()
        self.backward.clear()
        self.order.clear()
        self._started.clear()

    def snapshot(self) -> Trace:
        return Trace(forward=dict(self.forward), backward=dict(self.backward), order=list(self.order),
                     inputs=dict(self.inputs), reached=set(self.reached))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
