"""Megatron-core (`megatron.core`): the integration's stable import surface.

The names users import (the case factories, the step configs) are re-exported here, so that a
user's case file imports `from sp_harness.cases.frameworks.megatron import ...` whichever module of the
package holds them today (docs/frameworks/README.md: one package per framework, the same file names
in each). Importing it imports no framework code.
"""

from __future__ import annotations

from sp_harness.cases.frameworks.megatron.case import (
    GPT_KWARGS,
    MEGATRON_CORE_VERSION,
    POSITION_EMBEDDINGS,
    GradSync,
    drop_sequence_parallel_flag,
    flagged_attention_sinks,
    load_shard,
    megatron_case,
    megatron_shard,
    partition_stride_one,
    router_counts_over_dp_group,
    strided_index,
)
from sp_harness.cases.frameworks.megatron.module import cross_attention, megatron_module_case
from sp_harness.cases.frameworks.megatron.step import MegatronStepConfig, megatron_train_case

__all__ = ['GPT_KWARGS', 'GradSync', 'MEGATRON_CORE_VERSION', 'MegatronStepConfig', 'POSITION_EMBEDDINGS', 'cross_attention', 'drop_sequence_parallel_flag', 'flagged_attention_sinks', 'load_shard', 'megatron_case', 'megatron_module_case', 'megatron_shard', 'megatron_train_case', 'partition_stride_one', 'router_counts_over_dp_group', 'strided_index']
