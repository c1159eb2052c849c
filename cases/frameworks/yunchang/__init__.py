"""Yunchang's USP (Ulysses x ring): the integration's stable import surface.

The names users import (the case factories, the step configs) are re-exported here, so that a
user's case file imports `from sp_harness.cases.frameworks.yunchang import ...` whichever module of the
package holds them today (docs/frameworks/README.md: one package per framework, the same file names
in each). Importing it imports no framework code.
"""

from __future__ import annotations

from sp_harness.cases.frameworks.yunchang.case import (
    ATTN_TYPES,
    CAUSAL_ONLY,
    CPU_ATTN_TYPES,
    GPU_ONLY_ATTN_TYPES,
    LAYERS,
    MAX_LAYERS,
    NO_BACKWARD_ATTN_TYPES,
    RING_IMPLS,
    SYNC_GROUPS,
    ULYSSES_TORCH_KERNEL,
    YUNCHANG_VERSION,
    ModelFactory,
    YunchangCase,
    attn_type_of,
    expect_float32_alias,
    expect_torch_math,
    refuse_gloo_ring_of_one,
    refuse_on_cpu_tensors,
    ulysses_case,
    usp_case,
    validate_attn_type,
    yunchang_shard,
)

__all__ = ['ATTN_TYPES', 'CAUSAL_ONLY', 'CPU_ATTN_TYPES', 'GPU_ONLY_ATTN_TYPES', 'LAYERS', 'MAX_LAYERS', 'ModelFactory', 'NO_BACKWARD_ATTN_TYPES', 'RING_IMPLS', 'SYNC_GROUPS', 'ULYSSES_TORCH_KERNEL', 'YUNCHANG_VERSION', 'YunchangCase', 'attn_type_of', 'expect_float32_alias', 'expect_torch_math', 'refuse_gloo_ring_of_one', 'refuse_on_cpu_tensors', 'ulysses_case', 'usp_case', 'validate_attn_type', 'yunchang_shard']
