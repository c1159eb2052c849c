"""Stage: step. yunchang's CPU shims, each only where no GPU is visible (docs/frameworks/
yunchang.md, "The CPU shims"):
- `cpu_shims`: its flash-attention kernels pointed at `flash_attn_standin`. yunchang's
  pure-torch attention types have no backward and no CPU path, so its default FA path is the one
  that runs (LongContextAttention's ring kernels and UlyssesAttention's `flash_attn_func`);
- `import_yunchang` and `ulysses_layer`: two GPU probes some releases make (at import, and in
  `UlyssesAttention.__init__`) answered as a GPU would, their answers unused by the math.
Nothing else of yunchang is touched."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

_SHIMMED = False


def cpu_shims(device: torch.device | None = None) -> None:
    """The CPU shim, the only one; a no-op for ranks on a GPU (`device`: the rank's; None: the
    CPU, unless CUDA is available), idempotent.

    yunchang's default attention type (`AttnType.FA`) calls flash-attn's `_flash_attn_forward` /
    `_flash_attn_backward` for each ring block (`yunchang.kernels.attention.flash_attn_forward`
    / `flash_attn_backward`), which exist only as CUDA kernels; its torch types
    (`TORCH_FLASH`, `TORCH_EFFICIENT`, ...) have no backward at all (`pytorch_attn_backward`
    raises). Here those two names, `flash_attn` (for its `__version__`) and `HAS_FLASH_ATTN` in
    `yunchang.kernels.attention` point at `flash_attn_standin`: the same interface computing
    exact attention in torch; and `flash_attn_func` and `HAS_FLASH_ATTN` in `yunchang.kernels`
    (what `UlyssesAttention` calls on the FA path) at the stand-in's `flash_attn_func`, the same
    two kernels under autograd. Nothing else of yunchang is touched: its ring loop, p2p, LSE merge,
    float32 accumulators and all-to-alls run as shipped."""
    global _SHIMMED
    on_gpu = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if _SHIMMED or on_gpu:
        return
    import yunchang.kernels as package
    from yunchang.kernels import attention as kernels

    from sp_harness.cases.frameworks import flash_attn_standin

    kernels.flash_attn = flash_attn_standin
    kernels._flash_attn_forward = flash_attn_standin._flash_attn_forward
    kernels._flash_attn_backward = flash_attn_standin._flash_attn_backward
    kernels.HAS_FLASH_ATTN = True
    # UlyssesAttention's FA path asks the package for flash-attn's public autograd function
    # (`select_flash_attn_impl(FA, "fwd-bwd")` returns `yunchang.kernels.flash_attn_func`, bound
    # only where flash-attn imported): the stand-in's, the same two kernels under autograd
    package.flash_attn_func = flash_attn_standin.flash_attn_func
    package.HAS_FLASH_ATTN = True
    _SHIMMED = True


@contextlib.contextmanager
def _answered(owner: Any, name: str, answer: Callable[..., Any]) -> Iterator[None]:
    """`owner.name` replaced by `answer` for the block, where no GPU is visible (else untouched)."""
    if torch.cuda.is_available():
        yield
        return
    old = getattr(owner, name)
    setattr(owner, name, answer)
    try:
        yield
    finally:
        setattr(owner, name, old)


def import_yunchang() -> None:
    """`import yunchang`, which on a CPU-only torch crashes for yunchang 0.6.2 and 0.6.3.post1:
    their `yunchang.ring.ring_flashinfer_attn` calls `torch.utils.cpp_extension.
    _get_cuda_arch_flags()` at import and discards the result (it warms FlashInfer's JIT arch
    list). On CUDA that call returns the visible GPUs' `-gencode` flags; with no device to read it
    raises IndexError (`arch_list[-1]` of an empty list). For the import alone, where no GPU is
    visible, it answers no flags: the value was discarded, so nothing yunchang computes changes,
    and yunchang's FlashInfer path stays unusable here (its CUDA kernels; the attn_type is
    UNSUPPORTED on CPU ranks). A release that makes no such call is imported as it is."""
    if "yunchang" in sys.modules:
        return
    import torch.utils.cpp_extension as cpp_extension

    with _answered(cpp_extension, "_get_cuda_arch_flags", lambda *args, **kwargs: []):
        import yunchang  # noqa: F401


CPU_DEVICE_NAME = "cpu (no CUDA device: sp-harness's CPU ranks)"
"""What `torch.cuda.get_device_name` answers during `ulysses_layer` where no GPU is visible."""


def ulysses_layer(make: Callable[[], Any]) -> Any:
    """`make()` (a `UlyssesAttention(...)`), whose `__init__` in yunchang 0.5.0 to 0.6.3.post1
    reads `torch.cuda.get_device_name(device)` to swap its attention type for the torch path on
    a Turing / Tesla / T4 GPU (flash-attn 2 has no kernels there); a CPU-only torch raises
    ("Torch not compiled with CUDA enabled"). During the construction alone, where no GPU is
    visible, the name is `CPU_DEVICE_NAME`, which none of those match: the attention type the
    case asks for is kept, as yunchang keeps it on every GPU flash-attn 2 runs on. The layer's
    computation is unchanged; 0.6.4 reads no device name."""
    with _answered(torch.cuda, "get_device_name", lambda *args, **kwargs: CPU_DEVICE_NAME):
        return make()


__all__ = ["CPU_DEVICE_NAME", "cpu_shims", "import_yunchang", "ulysses_layer"]
