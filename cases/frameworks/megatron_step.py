"""Moved to `sp_harness.cases.frameworks.megatron.step`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.megatron.step import (
    MegatronStepConfig,
    MegatronTrainStep,
    cuda_on_cpu,
    drop_tensor_parallel_flag,
    megatron_step_shard,
    megatron_train_case,
)

__all__ = ['MegatronStepConfig', 'MegatronTrainStep', 'cuda_on_cpu', 'drop_tensor_parallel_flag', 'megatron_step_shard', 'megatron_train_case']
