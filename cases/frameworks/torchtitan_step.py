"""Moved to `sp_harness.cases.frameworks.torchtitan.step`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.torchtitan.step import (
    TitanStepConfig,
    TitanTrainStep,
    titan_step_shard,
    titan_train_case,
)

__all__ = ['TitanStepConfig', 'TitanTrainStep', 'titan_step_shard', 'titan_train_case']
