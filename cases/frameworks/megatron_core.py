"""Moved to `sp_harness.cases.frameworks.megatron.case`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.megatron.case import (
    GPT_KWARGS,
    MEGATRON_CORE_VERSION,
    POSITION_EMBEDDINGS,
    GradSync,
    drop_sequence_parallel_flag,
    load_shard,
    megatron_case,
    megatron_shard,
    partition_stride_one,
    router_counts_over_dp_group,
    strided_index,
)

__all__ = ['GPT_KWARGS', 'MEGATRON_CORE_VERSION', 'POSITION_EMBEDDINGS', 'GradSync', 'drop_sequence_parallel_flag', 'load_shard', 'megatron_case', 'megatron_shard', 'partition_stride_one', 'router_counts_over_dp_group', 'strided_index']
