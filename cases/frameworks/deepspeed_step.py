"""Moved to `sp_harness.cases.frameworks.deepspeed.step`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.deepspeed.step import (
    REGRESSIONS,
    DeepSpeedStepConfig,
    DeepSpeedTrainStep,
    ds_step_case,
    ds_step_shard,
    engine_config,
    regressed,
)

__all__ = ['DeepSpeedStepConfig', 'DeepSpeedTrainStep', 'REGRESSIONS', 'ds_step_case', 'ds_step_shard', 'engine_config', 'regressed']
