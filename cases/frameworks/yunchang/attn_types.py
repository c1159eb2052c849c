"""Stage: step. yunchang's attention types (`AttnType` values) as the harness's yunchang cases
take them: which run on CPU ranks, which need a GPU kernel (UNSUPPORTED, with the kernel named),
which have no backward; decided from the config before any rank starts where no GPU is visible,
and by the ranks from their device otherwise."""

from __future__ import annotations

import torch

from sp_harness import Unsupported
from sp_harness.config.check_config import CheckConfig

CPU_ATTN_TYPES = ("fa", "torch_math")
"""`AttnType` values whose kernels run on CPU ranks: FA (flash-attn's kernels, the CPU stand-in
where no GPU is visible) and TORCH_MATH (torch's math SDPA; yunchang gives it no backward)."""
GPU_ONLY_ATTN_TYPES = {
    "torch_flash": "aten's _scaled_dot_product_flash_attention, which has no CPU kernel",
    "torch_efficient": "aten's _scaled_dot_product_efficient_attention, which has no CPU kernel",
    "torch_cudnn": "cuDNN's SDPA backend (CUDA only)",
    "fa3": "flash-attn 3's Hopper CUDA kernels",
    "flashinfer": "FlashInfer's CUDA kernels",
    "aiter": "AITER's ROCm kernels",
    "sage_auto": "SageAttention's CUDA kernels", "sage_fp16": "SageAttention's CUDA kernels",
    "sage_fp16_triton": "SageAttention's Triton GPU kernels", "sage_fp8": "SageAttention's CUDA kernels",
    "sage_fp8_sm90": "SageAttention's Hopper CUDA kernels", "sparse_sage": "SpargeAttn's CUDA kernels",
    "npu": "torch_npu's Ascend NPU kernels",
    # the name of the torch path before 0.6.4 split it into torch_math / torch_flash / ...
    "torch": "aten's fused SDPA kernels (_scaled_dot_product_efficient_attention, from yunchang 0.6.2 "
             "_scaled_dot_product_flash_attention), which have no CPU kernel (0.5.0's torch SDPA returns no LSE for "
             "its ring to merge)",
}
"""The other `AttnType` values, each with the kernel it runs: UNSUPPORTED on this harness's CPU ranks."""
NO_BACKWARD_ATTN_TYPES = ("torch_math",)
"""yunchang 0.6.4's `pytorch_attn_backward` raises ("Not implemented backward for PyTorch attention
types"): these run forward only."""


def attn_type_of(name: str):
    """The installed yunchang's attention-type member for its value `name` (its `AttnType`;
    `FlashAttentionImpl` before 0.6.0: yunchang_compat.attn_type_enum). A value of another
    release (`ATTN_TYPES`: every release in range) that this one lacks is Unsupported, naming
    this release's values; any other name a ValueError."""
    from sp_harness.cases.frameworks.yunchang import compat

    enum = compat.attn_type_enum()
    try:
        return enum(name)
    except ValueError:
        values = [t.value for t in enum]
        if name in (*CPU_ATTN_TYPES, *GPU_ONLY_ATTN_TYPES):
            raise Unsupported(f"yunchang attn_type {name!r} is not one of the installed release's "
                              f"{enum.__name__} values ({', '.join(values)})") from None
        raise ValueError(f"attn_type {name!r}: one of {values}") from None


def refuse_on_cpu_tensors(attn_type: str, device: torch.device | None) -> None:
    """Unsupported for an attention type whose kernels do not run where the rank's tensors are:
    decided before any rank starts where no GPU is visible (`validate_attn_type`); ranks on the
    CPU of a GPU machine (gloo) say so from their device."""
    if attn_type in GPU_ONLY_ATTN_TYPES and (device is None or device.type == "cpu"):
        raise Unsupported(f"yunchang attn_type {attn_type!r} runs {GPU_ONLY_ATTN_TYPES[attn_type]}; this run's "
                          f"ranks hold CPU tensors (attn_types that run on CPU: {', '.join(CPU_ATTN_TYPES)})")


def validate_attn_type(cfg: CheckConfig, attn_type: str) -> None:
    """The attention type's own limits, from the config alone."""
    if not torch.cuda.is_available():
        refuse_on_cpu_tensors(attn_type, None)
    if attn_type in NO_BACKWARD_ATTN_TYPES and not cfg.forward_only:
        raise Unsupported(f"yunchang attn_type {attn_type!r} has no backward (its pytorch_attn_backward raises "
                          "'Not implemented backward for PyTorch attention types'): forward-only runs")


__all__ = ["CPU_ATTN_TYPES", "GPU_ONLY_ATTN_TYPES", "NO_BACKWARD_ATTN_TYPES", "attn_type_of", "refuse_on_cpu_tensors",
           "validate_attn_type"]
