"""Stage: step. What verl's FSDP SFT step needs to run on a CPU rank over gloo: a CPU platform
for verl's device layer, an exact stand-in for the one flash-attn kernel call, the attention name
that routes the HF model through transformers' (and so verl's patched) flash-attention path, and
a guard around one import verl makes of an unrelated trl class. Nothing else is replaced: the
engine, FSDP2, the Ulysses padding / slicing / all-to-alls / gather, the loss and the optimizer
step run as verl 0.9.1 ships them.

1. The platform (`use_cpu_platform`). What CUDA does: verl asks its platform singleton
   (verl.plugin.platform.get_platform, auto-detected, falling back to 'nvidia') for the device
   name ('cuda': the device meshes, autocast, `init_device_mesh`) and the current device index
   (`get_device_id()`: `torch.cuda.current_device()`, where `micro_batch.to(...)`,
   `batch_num_tokens.to(...)`, FSDP2's state-dict broadcast and the clip norm's `.to(...)` put
   their tensors). On a CPU-only torch that index call raises. What the shim changes: a
   `PlatformBase` whose device is 'cpu' and whose current device is 'cpu', set with verl's own
   `set_platform` before any verl engine module is imported (transformer_impl reads the device
   name at import). Why the math is unchanged: it decides where tensors live, never a value;
   every `.to(device)` is then a no-op on CPU tensors, and the meshes are gloo's.
2. The kernel (`varlen_attention`). What CUDA does: verl's `_ulysses_flash_attention_forward`
   (verl.models.transformers.monkey_patch, installed by `apply_monkey_patch` as transformers'
   `integrations.flash_attention._flash_attention_forward`) does the Ulysses all-to-alls and
   calls transformers' `_flash_attention_forward`, which, with `attention_mask` None and packed
   `position_ids`, runs flash-attn's `flash_attn_varlen_func` over the segments the position
   ids start (`prepare_fa_kwargs_from_position_ids`), causal inside each. flash-attn has no CPU
   kernels. What the shim changes: that one name inside verl's module (`monkey_patch.
   _flash_attention_forward`) is this function: the same segments, from transformers' own
   `prepare_fa_kwargs_from_position_ids`, each one causal attention by torch's
   `scaled_dot_product_attention` in the inputs' dtype, k/v heads repeated for grouped queries
   as flash-attn reads them. Why the math is unchanged: it is exact attention over the same
   segments with the same scale; flash-attn's tiling and online softmax are rounding, not
   semantics. What differs on GPU: flash-attn takes only float16 / bfloat16 (a float32 run
   there needs verl's default bf16 mixed precision); the stand-in computes float32 in float32.
3. The attention name (`register_attention`). transformers refuses
   `attn_implementation="flash_attention_2"` where flash-attn is not installed. The shim
   registers transformers' own `flash_attention_forward` and `flash_attention_mask` (the
   functions 'flash_attention_2' maps to) under `ATTENTION`, through transformers' public
   `AttentionInterface.register` / `AttentionMaskInterface.register`, and the model is built
   with that name (HFModelConfig's `override_config`). Every call in between is the one
   flash_attention_2 makes: the model's attention modules call `flash_attention_forward`, which
   calls the (verl-patched) `_flash_attention_forward` with `attention_mask` None.
4. trl (`no_trl_value_head_patch`). `apply_monkey_patch` imports trl's
   `AutoModelForCausalLMWithValueHead`, where trl is installed, to patch that class's
   `state_dict`; trl 1.x has no such class, so the import raises and the engine never builds.
   That class is the value-head (critic) model's, never built by the SFT step: the shim answers
   verl's `is_trl_available()` False inside `monkey_patch` alone. No value changes.

Each is idempotent and applied once per rank process by the case's setup and the step
(`cpu_shims`): items 1-3 only where CUDA is absent, item 4 everywhere."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

ATTENTION = "verl_cpu_varlen"
"""The attention name the engine's model is built with (item 3): flash_attention_2's functions,
under a name transformers does not check for flash-attn."""

_APPLIED: set[str] = set()


def _cpu_platform_class() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUPlatform(PlatformBase):
        """verl's platform for a CPU rank over gloo (item 1 of the module doc)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str):
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return CPUPlatform


def use_cpu_platform() -> None:
    """Item 1: verl's platform singleton is the CPU one (before any engine module is imported)."""
    if "platform" in _APPLIED:
        return
    from verl.plugin.platform import platform_manager

    platform_manager.set_platform(_cpu_platform_class()())
    _APPLIED.add("platform")


def varlen_attention(query_states: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                     attention_mask: torch.Tensor | None, query_length: int, is_causal: bool = True,
                     dropout: float = 0.0, position_ids: torch.Tensor | None = None,
                     softmax_scale: float | None = None, sliding_window: int | None = None,
                     softcap: float | None = None, **kwargs: Any) -> torch.Tensor:
    """Item 2: transformers' `_flash_attention_forward` on packed sequences, exactly: q, k, v
    (1, S, H, D) (k, v with Hk heads dividing H), segments where `position_ids` restart, causal
    attention inside each; returns (1, S, H, D) in q's dtype."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    if attention_mask is not None or position_ids is None:
        raise NotImplementedError("the flash-attn stand-in runs verl's packed path only: attention_mask None and "
                                  "position_ids given (use_remove_padding)")
    if dropout or (sliding_window is not None and sliding_window > 0) or softcap:
        raise NotImplementedError("the flash-attn stand-in models no dropout, sliding window or softcap")
    if not is_causal:
        raise NotImplementedError("the flash-attn stand-in models causal attention only (a causal LM's)")
    (cu_seqlens, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
    q, k, v = (t.transpose(1, 2) for t in (query_states, key_states, value_states))  # (1, H, S, D)
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    bounds = cu_seqlens.tolist()
    pieces = [torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                               is_causal=True, scale=softmax_scale)
              for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    return torch.cat(pieces, dim=2).transpose(1, 2)


def stand_in_flash_kernel() -> None:
    """Item 2: verl's Ulysses attention calls `varlen_attention` where it calls flash-attn."""
    if "kernel" in _APPLIED:
        return
    from verl.models.transformers import monkey_patch

    module: Any = monkey_patch  # a module global rebound, whatever its declared type
    module._flash_attention_forward = varlen_attention
    _APPLIED.add("kernel")


def register_attention() -> None:
    """Item 3: `ATTENTION` names transformers' flash_attention_2 functions."""
    if "attention" in _APPLIED:
        return
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION, flash_attention_forward)
    AttentionMaskInterface.register(ATTENTION, flash_attention_mask)
    _APPLIED.add("attention")


def no_trl_value_head_patch() -> None:
    """Item 4: `apply_monkey_patch` skips its trl value-head block."""
    if "trl" in _APPLIED:
        return
    from verl.models.transformers import monkey_patch

    module: Any = monkey_patch  # a module global rebound, whatever its declared type
    module.is_trl_available = lambda: False
    _APPLIED.add("trl")


def platform_where_cpu() -> None:
    """Item 1 where CUDA is absent: the first of `PRELOAD`, before verl's engine module is imported."""
    if on_cpu():
        use_cpu_platform()


PRELOAD = ("transformers.models.llama.modeling_llama", f"{__name__}:platform_where_cpu",
           "verl.workers.engine.fsdp.transformer_impl")
"""A verl case's `Case.preload`: the model, verl's platform (item 1), then its FSDP engine (which
imports the Trainer and pyarrow: pyarrow's jemalloc thread is off in a fork server,
zygote_server.ARROW_JEMALLOC_ENV); once by the fork server on CPU. Items 2-4 stay the case's
per-process setup: they patch a module every rank then holds (cheap after the preload)."""


def on_cpu() -> bool:
    """Whether this rank runs verl on the CPU (a CPU-only torch): items 1-3 apply only then."""
    return not torch.cuda.is_available()


def attention_name() -> str:
    """The `attn_implementation` the engine's model is built with: `ATTENTION` on the CPU (item
    3), flash_attention_2 where CUDA is (verl's default, flash-attn's own kernels)."""
    return ATTENTION if on_cpu() else "flash_attention_2"


def cpu_shims() -> None:
    """The shims of the module doc, once per process: items 1-3 where CUDA is absent (the
    platform first), item 4 (not a CPU matter: trl 1.x against verl 0.9.1) everywhere."""
    if on_cpu():
        use_cpu_platform()
        register_attention()
        stand_in_flash_kernel()
    no_trl_value_head_patch()


__all__ = ["ATTENTION", "PRELOAD", "platform_where_cpu", "attention_name", "cpu_shims", "no_trl_value_head_patch", "on_cpu", "register_attention", "stand_in_flash_kernel",
           "use_cpu_platform", "varlen_attention"]
