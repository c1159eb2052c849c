"""Stage: capture. What one transformer layer saves for backward, per rank.

Per rank, the bytes autograd saves for backward while ONE transformer layer (`blocks[0]` of the
model) runs its forward, recorded with `torch.autograd.graph.saved_tensors_hooks` (entered by a
forward pre-hook on the layer, left by its forward hook). Each storage is counted once (keyed by
`untyped_storage().data_ptr()`, sized by `untyped_storage().nbytes()`, so a saved view keeps its
whole storage alive and is charged for it), and storages that belong to a parameter are left out:
they are weights, not activations. Every saved tensor is also labelled with the innermost
submodule that saved it, which gives the norm-region share on its own.

The activation-memory check runs this meter on the reference's layer in-process (no
parallelism) and, in its rank job (sp_harness.checks.activation_memory_rank), on the case's
sharded model with the tokens and shards the engine would hand it; the formulas and the gate are
in sp_harness.checks.activation_memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

NORM_REGION = ("norm1", "norm2")

@dataclass
class SavedRecord:
    region: str
    """Innermost submodule of the layer that saved it ('' for the layer itself)."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    param: bool


@dataclass
class LayerMemory:
    """What one layer saved for backward on one rank."""

    rank: int = 0
    records: list[SavedRecord] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if not r.param)

    @property
    def param_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if r.param)

    def region_bytes(self, prefixes=NORM_REGION) -> int:
        return sum(r.nbytes for r in self.records if not r.param and r.region.split(".")[0] in prefixes)

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            if not r.param:
                out[r.region] = out.get(r.region, 0) + r.nbytes
        return out


class SavedTensorMeter:
    """Records the storages autograd saves while `layer` runs forward (parameters flagged)."""

    def __init__(self, layer: nn.Module, params_of: nn.Module | None = None):
        self.layer = layer
        self.result = LayerMemory()
        self._seen: set[int] = set()
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in (params_of or layer).parameters()}
        self._stack: list[str] = []
        self._ctx = None
        self._handles: list[RemovableHandle] = []

    def _pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except Exception:  # tensors without storage (subclasses): not activations we can size
            return t
        key = storage.data_ptr()
        if key in self._seen:
            return t
        self._seen.add(key)
        region = self._stack[-1] if self._stack else ""
        self.result.records.append(SavedRecord(region=region, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                                               nbytes=storage.nbytes(), param=isinstance(t, nn.Parameter) or key in self._param_ptrs))
        return t

    def __enter__(self):
        def enter(_m, _args):
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._ctx.__enter__()

        def leave(_m, _args, _out):
            self._ctx.__exit__(None, None, None)
            self._ctx = None

        self._handles.append(self.layer.register_forward_pre_hook(enter))
        self._handles.append(self.layer.register_forward_hook(leave))
        for name, sub in self.layer.named_modules():
            if not name:
                continue
            self._handles.append(sub.register_forward_pre_hook(self._push(name)))
            self._handles.append(sub.register_forward_hook(self._pop))
        return self

    def _push(self, name: str):
        def hook(_m, _args) -> None:
            self._stack.append(name)
        return hook

    def _pop(self, _m, _args, _out) -> None:  # a forward hook's return value would replace the output
        self._stack.pop()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


def find_layer(model: nn.Module) -> nn.Module:
    """The first transformer layer: `model.blocks[0]` (reference GPT, Megatron twin, DTensor GPT)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ValueError(f"{type(model).__name__} has no `blocks`: cannot find a transformer layer to measure")
    return blocks[0]
