"""Stage: step. yunchang's one CPU shim: its flash-attention kernels pointed at
`flash_attn_standin`, only where the ranks run on the CPU (docs/frameworks/yunchang.md, "The CPU
shim"). yunchang's pure-torch attention types have no backward and no CPU path, so its default
FA path is the one that runs (LongContextAttention's ring kernels and UlyssesAttention's
`flash_attn_func`); nothing else of yunchang is touched."""

from __future__ import annotations

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


__all__ = ["cpu_shims"]
