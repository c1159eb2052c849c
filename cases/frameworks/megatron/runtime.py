"""Stage: step. megatron-core's process state for a rank, and its CPU shims: what a megatron-core
case sets up before building a model (sp_harness.cases.frameworks.megatron.case). `cpu_shims` is
the only place the integration changes what megatron does, and only what CUDA would do; each
shim says why the math is unchanged (docs/frameworks/megatron-core.md, "CPU shims").
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

_SHIMMED = False


def cpu_shims() -> None:
    """The CPU shims, all of them; a no-op where CUDA is available, idempotent. Each replaces a
    call that would raise on a CPU-only torch with the same computation on the CPU, so what
    megatron computes is unchanged:

    1. `torch.cuda.current_device()` returns "cpu": megatron allocates its global memory buffer
       (the scratch of the SP all-gather) and its DDP grad buffers on that device.
    2. The default causal mask: `fused_softmax` builds `torch.triu(ones(sq, sq), 1)` on "cuda"
       when the attention gets no mask; the same mask, built on the CPU.
    3. The RNG tracker: megatron forks a named CUDA RNG state around the embedding's dropout under
       SP. A tracker with the same add/fork semantics over the CPU generator stands in; no random
       number is drawn inside a fork, because the case requires dropout 0 (`validate`).
    4. The LayerNorm: without apex or TransformerEngine the local spec's `WrappedTorchNorm`
       refuses `sequence_parallel`; it becomes the same `torch.nn.LayerNorm` / `RMSNorm` with each
       param flagged `sequence_parallel` as megatron's `FusedLayerNorm` flags its own (the flag
       that `finalize_model_grads` sums TP grads by).
    5. The MoE router's gating linear: without TransformerEngine `moe_utils` never binds
       `te_general_gemm` (its import fallback forgets it), so the router's `is not None` test raises
       NameError; bound to None, megatron takes its own `torch.mm` branch in the router dtype.
    6. RoPE under context parallelism: `get_pos_emb_on_this_cp_rank` makes its two-element chunk
       index (CP rank r's chunks r and 2CP-1-r) pinned on the host and moves it with `.cuda()`;
       megatron's own function runs under `cpu_index` (the index made on the CPU, unpinned), every
       module that imported it given the wrapped one. The same index selects the same rows.
    7. The DDP grad sync's stream wait: from 0.17 `start_grad_sync` asks
       `torch.cuda.current_stream()` to wait for the events a local CUDA-graph replay leaves on
       params (none exist without CUDA graphs). On the CPU ops run in program order, so the
       stand-in stream's waits have nothing to wait for; the grads reduced are the same.
    """
    global _SHIMMED
    if _SHIMMED or torch.cuda.is_available():
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import torch_norm

    # megatron places tensors on torch.cuda.current_device(); on CPU the shim answers a device name
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # a str where torch says int
    # made in bool directly: a float ones() would show as a float32 island in a float64 run
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise Exception(f"rng state {name} / seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, 2718)

    def sp_capable_norm(cls, config, hidden_size, eps=1e-5, **_unused):
        norm_cls = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm on CPU")
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = sp_capable_norm

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the name its non-TE branch tests
    _cp_rope_index_on_cpu()
    torch.cuda.current_stream = lambda device=None: _HOST_ORDER  # type: ignore[assignment,return-value]
    _SHIMMED = True


class _HostOrder:
    """torch.cuda's current stream on the CPU (shim 7): the host runs ops in program order."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


_HOST_ORDER = _HostOrder()


class _IndexOnCPU(TorchFunctionMode):
    """`cpu_index`'s mode: `pin_memory=True` made False and `Tensor.cuda()` answered with the
    tensor itself (a CPU-only torch can do neither)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def cpu_index() -> contextlib.AbstractContextManager:
    """While entered (where CUDA is absent), megatron's small host-to-device index copies stay on
    the CPU: the CP chunk index `get_pos_emb_on_this_cp_rank` (and, in older releases,
    `get_batch_on_this_cp_rank`) pins and moves with `.cuda()`. The same values, one device."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _IndexOnCPU()


def _cp_rope_index_on_cpu() -> None:
    """Shim 6: megatron's `get_pos_emb_on_this_cp_rank` run under `cpu_index`, in every megatron
    module that bound the name."""
    import sys

    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils.get_pos_emb_on_this_cp_rank

    @functools.wraps(original)
    def get_pos_emb_on_this_cp_rank(*args, **kwargs):
        with cpu_index():
            return original(*args, **kwargs)

    # the modules that import it (rotary_pos_embedding, yarn, ...) are imported by the GPT model's
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "get_pos_emb_on_this_cp_rank", None) is original:
            setattr(module, "get_pos_emb_on_this_cp_rank", get_pos_emb_on_this_cp_rank)  # noqa: B010  # a ModuleType


def one_rank_groups(group: dist.ProcessGroup):
    """Every group a TP=1 GPTModel asks for, each `group` (one rank)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    # the expert groups too (MoE's router, dispatcher and experts ask for them)
    names = ("tp", "cp", "pp", "mp", "embd", "pos_embd", "dp", "dp_cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
             "tp_dp_cp", "expt_dp")
    return ProcessGroupCollection(**{n: group for n in names})


ORDER = "tp-cp-ep-dp-pp"
"""megatron's default rank order: TP groups of consecutive ranks, the harness's layout."""
TRANSPOSED_ORDER = "dp-tp-cp-ep-pp"
"""DP varies fastest: at DP > 1 megatron's TP groups are the harness's DP groups (a second TP layout)."""


def parallel_state(tp: int, tp_ranks: tuple[int, ...], *, order: str = ORDER, cp: int = 1,
                   cp_ranks: tuple[int, ...] = ()) -> None:
    """megatron's global groups for TP `tp` and CP `cp` in rank order `order`, this rank's TP
    group expected to be `tp_ranks` and its CP group `cp_ranks` (at CP > 1: the engine's sequence
    group; megatron's default order puts CP next to TP, so at TP 1 its CP groups are consecutive
    ranks, the engine's). Made once per rank process and layout; a warm pool's job on another mesh
    or order rebuilds them (`new_group` is a collective every rank runs alike)."""
    from megatron.core import parallel_state as ps

    def ranks(group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group))

    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() == tp and ps.get_context_parallel_world_size() == cp and \
                ps.get_data_parallel_world_size() * tp * cp == dist.get_world_size() and \
                ranks(ps.get_tensor_model_parallel_group()) == tp_ranks and \
                (cp == 1 or ranks(ps.get_context_parallel_group()) == cp_ranks):
            return
        ps.destroy_model_parallel()
    ps.destroy_global_memory_buffer()  # a TP=1 reference built in this process made one; megatron makes its own
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 create_gloo_process_groups=False, order=order)
    theirs = ranks(ps.get_tensor_model_parallel_group())
    if theirs != tp_ranks:
        raise RuntimeError(f"megatron's TP group {theirs} is not the expected {tp_ranks} (order {order})")
    if cp > 1 and ranks(ps.get_context_parallel_group()) != cp_ranks:
        raise RuntimeError(f"megatron's CP group {ranks(ps.get_context_parallel_group())} is not the engine's "
                           f"sequence group {cp_ranks} (order {order})")


@contextlib.contextmanager
def global_tp_group(group: dist.ProcessGroup):
    """megatron's global TP (and, where unset, DP) group is `group` while entered: a TP=1
    reference is built where a TP=1 run's megatron state would be, so a layer that reads the
    global TP group instead of its `pg_collection` (Megatron-LM #7452 finding 6) still builds at
    TP 1 and captures the reference's one-rank group, not the sharded twin's."""
    from megatron.core import parallel_state as ps

    saved = ps._TENSOR_MODEL_PARALLEL_GROUP, ps._DATA_PARALLEL_GROUP
    ps._TENSOR_MODEL_PARALLEL_GROUP = group
    if ps._DATA_PARALLEL_GROUP is None:  # megatron's is_initialized() reads it
        ps._DATA_PARALLEL_GROUP = group
    try:
        yield
    finally:
        ps._TENSOR_MODEL_PARALLEL_GROUP, ps._DATA_PARALLEL_GROUP = saved


def global_memory_buffer() -> None:
    """megatron's process-wide scratch buffer (attention's baddbmm output, the SP all-gather):
    made by `initialize_model_parallel`, and needed by a TP=1 model built without it."""
    from megatron.core import parallel_state as ps

    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()



__all__ = ["ORDER", "TRANSPOSED_ORDER", "cpu_index", "cpu_shims", "global_memory_buffer", "global_tp_group", "one_rank_groups", "parallel_state"]
