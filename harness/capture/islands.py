"""Stage: capture. Precision islands: ops of the sharded run that computed below the run's dtype.

Frameworks compute some ops in float32 on purpose (megatron-core's cross-entropy, torchtitan's
RoPE). In a float64 run such an op rounds at float32's eps: the tolerance model rounds it so in
the perturbed reference (sp_harness.step.rounding), and this observer names it, so a reader of a
FAIL sees the float32 op among the candidate causes and a reader of a PASS knows which ops were
judged at which precision. It watches the sharded forward and backward of step 0 only: islands
are a property of the code, not of the data, and later steps pay nothing.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sp_harness.step.modules import ModuleStack
from sp_harness.step.rounding import coarser_dtypes

MAX_SHOWN = 8
"""Distinct islands a report lists; the rest are counted."""
OUTSIDE = "loss"
"""The module name of ops outside the model's modules: in a step, the loss (sp_harness.step.inputs)."""
DECLARED = "declared"
"""`Island.op` and `Island.where` of an island the case declared (Case.precision_islands)."""


@dataclass(kw_only=True, frozen=True)
class Island:
    """One op the sharded run computed below the run's dtype, or one island the case declared."""

    module: str
    """The innermost module running it (its name in the sharded model, the root by its class
    name, 'loss' outside the model); for a declared island, the declared module-name prefix."""
    op: str
    """The aten op ('aten._log_softmax'), or 'declared'."""
    dtype: str
    """The dtype its result was computed in ('float32')."""
    where: str
    """The source line that ran it in forward ('model.py:12': the first frame outside torch,
    '' where that is the engine's), 'backward' in backward, 'declared' for a declared island."""

    def describe(self) -> str:
        if self.op == DECLARED:
            return f"{self.module or '(whole model)'} (declared {self.dtype})"
        where = f", {self.where}" if self.where else ""
        return f"{self.module} ({self.op} {self.dtype}{where})"


def declared_islands(declared: Mapping[str, str]) -> list[Island]:
    return [Island(module=prefix, op=DECLARED, dtype=name, where=DECLARED) for prefix, name in declared.items()]


def summary(islands: list[Island], run_dtype: str, label: str = "precision islands") -> str:
    """One line: 'precision islands: 5 ops computed below float64: loss (aten._log_softmax,
    aten.nll_loss_forward float32, model.py:12), ...', '' for none. Ops of one module, dtype and
    source line share an entry; MAX_SHOWN entries are listed, the rest counted."""
    if not islands:
        return ""
    found = [i for i in islands if i.op != DECLARED]
    groups: dict[tuple[str, str, str], list[str]] = {}
    for i in found:
        groups.setdefault((i.module, i.dtype, i.where), []).append(i.op)
    entries = [f"{module} ({', '.join(ops)} {dtype}{', ' + where if where else ''})"
               for (module, dtype, where), ops in groups.items()]
    entries += [i.describe() for i in islands if i.op == DECLARED]
    parts = []
    if found:
        parts.append(f"{len(found)} op{'s' if len(found) != 1 else ''} computed below {run_dtype}")
    if len(entries) > len(groups):
        parts.append(f"{len(entries) - len(groups)} declared by the case")
    more = f" ... and {len(entries) - MAX_SHOWN} more" if len(entries) > MAX_SHOWN else ""
    return f"{label}: {'; '.join(parts)}: {'; '.join(entries[:MAX_SHOWN])}{more}"


class IslandObserver(TorchDispatchMode):
    """Records each distinct (module, op, dtype, source line) of an op whose floating result is
    of a dtype coarser than `run_dtype`, over what runs inside it. Views, copies and tensor
    factories are not computations and are skipped. A higher-order op (torch's `flex_attention`
    and its backward) is one op: its inner ops are the HOP's own dense implementation, which
    this mode does not see, and its result's dtype is the one it computed in."""

    supports_higher_order_operators = True
    """Without it torch raises NotImplementedError for any HOP under this mode: a FlexAttention
    model could not be checked at all."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Eager flex_attention runs its HOP through torch.compile(fullgraph=True), which refuses
        to trace under a mode that does not ignore compile internals; the compiled graph's ops
        still run under this mode (the HOP reaches __torch_dispatch__)."""
        return True

    def __init__(self, model: nn.Module, run_dtype: torch.dtype):
        super().__init__()
        self.coarse = coarser_dtypes(torch.finfo(run_dtype).eps)
        self.root = type(model).__name__
        self.stack = ModuleStack(model)
        self.found: dict[Island, None] = {}

    @property
    def islands(self) -> list[Island]:
        return list(self.found)

    def __enter__(self):
        self.stack.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.stack.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # its local ops run with the modes popped (as CommCounter's)
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in self.coarse and (_is_hop(func) or not _skipped(func)):
                self._record(func, t.dtype)
                break
        return out

    def _record(self, func, dtype: torch.dtype) -> None:
        inner = self.stack.innermost
        module = OUTSIDE if inner is None else inner or self.root
        backward = torch._C._current_graph_task_id() != -1
        where = "backward" if backward else _source_line()
        op = f"hop.{func.name()}" if _is_hop(func) else f"aten.{func._schema.name.split('::')[-1]}"
        self.found.setdefault(Island(module=module, op=op, dtype=str(dtype).removeprefix("torch."), where=where))


_NOT_COMPUTED = {torch.ops.aten.clone.default, torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default,
                 torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default,
                 torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default, torch.ops.aten.ones.default,
                 torch.ops.aten.full.default, torch.ops.aten.empty_strided.default}


def _is_hop(func) -> bool:
    return isinstance(func, torch._ops.HigherOrderOperator)


@functools.cache
def _skipped(func) -> bool:
    """Views (an alias, not in place) and ops that make or copy a tensor without arithmetic."""
    if func in _NOT_COMPUTED:
        return True
    schema = func._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# real paths: an editable install's files are links (setup.py), a wheel's are not
_ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
"""The engine's own folder (the sp_harness package, the source's harness/)."""
_CASE_DIRS = tuple(_ENGINE_DIR + name + os.sep for name in ("cases", "reference"))
"""Where an installed package keeps the built-in cases and references: inside the engine's
folder, yet their lines are the cases' own."""


@functools.cache
def _is_engine(filename: str) -> bool:
    path = os.path.realpath(filename)
    return path.startswith(_ENGINE_DIR) and not path.startswith(_CASE_DIRS)


_FX_CODE = "<eval_with_key>"
"""The file name of torch.fx's generated code (what torch.compile runs for eager flex_attention):
torch's, not the user's."""


def _source_line() -> str:
    """The first frame outside torch and this module: the user's line ('model.py:12'), or ''
    where that frame is the engine's own (the loss's mean over tokens, sp_harness.step.inputs)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename.startswith(_FX_CODE)):
        frame = frame.f_back
    if frame is None or _is_engine(frame.f_code.co_filename):
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
