"""Stage: capture. What one transformer layer saves for backward, per rank.

Per rank, the bytes autograd saves for backward while ONE transformer layer (`blocks[0]` of the
model) runs its forward, recorded with `torch.autograd.graph.saved_tensors_hooks` (entered by a
forward pre-hook on the layer, left by its forward hook). Each storage is counted once (keyed by
`untyped_storage().data_ptr()`, sized by `untyped_storage().nbytes()`, so a saved view keeps its
whole storage alive and is charged for it), and storages that belong to a parameter are left out:
they are weights, not activations. Every saved tensor is also labelled with the innermost
submodule that saved it, which gives the norm-region share on its own.

No parallelism is measured in-process on `reference.gpt.Block`; TP and TP+SP inside a real rank
job (`activation_rank`) on the case's sharded model, with the tokens and shards the engine would
hand it. The formulas and the gate are in sp_harness.checks.activation_memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sp_harness.config.check_config import CheckConfig

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


def memory_config(config: CheckConfig) -> CheckConfig:
    """The config the memory check measures: the case's defaults, ffn = 4h unless given, LayerNorm."""
    from sp_harness.config.registry import get_case

    cfg = get_case(config.case).resolve(config)
    if config.ffn is None:
        assert cfg.hidden is not None, f"case {cfg.case} resolves no hidden size: no layer to measure"
        cfg = cfg.replace(ffn=4 * cfg.hidden)
    return cfg


def measure_reference_layer(config: CheckConfig) -> LayerMemory:
    """No parallelism, in-process: the first layer of the case's reference fed [b, s, h] in the run
    dtype."""
    from sp_harness.config.registry import get_case
    from sp_harness.step.build import cast_floating, new_reference

    cfg = memory_config(config)
    block = cast_floating(find_layer(new_reference(get_case(cfg.case), cfg, None)), cfg.torch_dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    assert cfg.batch is not None and cfg.seq_len is not None and cfg.hidden is not None, "memory_config resolves the shape"
    x = torch.randn(cfg.dp * cfg.batch, cfg.seq_len, cfg.hidden, generator=gen, dtype=torch.float64)
    x = x.to(cfg.torch_dtype).requires_grad_(True)
    with SavedTensorMeter(block) as meter:
        y = block(x)
    y.float().sum().backward()
    return meter.result


def activation_rank(config: CheckConfig) -> LayerMemory:
    """Rank job: build the case's sharded model as the engine does, run one forward + backward
    (the engine's step, sp_harness.step.loop) on this rank's piece of a batch, and return what
    `blocks[0]` saved (the loss after the layer saves nothing inside it)."""
    from sp_harness.config.case import as_batch
    from sp_harness.step.build import build
    from sp_harness.step.inputs import batch_generator
    from sp_harness.step.loop import ShardedLoop

    built = build(config)
    meter = SavedTensorMeter(find_layer(built.sharded.module), params_of=built.sharded.module)

    def phase(name: str) -> None:
        # the forward only: a backward that recomputes the layer would be counted twice
        if name == "forward":
            meter.__enter__()
        else:
            meter.__exit__()

    loop = ShardedLoop(built, phase=phase)
    batch = as_batch(built.case.make_batch(config, 0, batch_generator(config.seed)))
    loop.forward_backward(loop.local_batch(batch), batch.target)
    meter.__exit__()
    meter.result.rank = built.ctx.rank
    return meter.result
