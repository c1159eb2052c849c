"""Moved to `sp_harness.cases.frameworks.megatron.module`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.megatron.module import (
    ModuleBuilder,
    cross_attention,
    first_output,
    harness_groups,
    megatron_module_case,
    transposed_tp_ranks,
)

__all__ = ['ModuleBuilder', 'cross_attention', 'first_output', 'harness_groups', 'megatron_module_case', 'transposed_tp_ranks']
