"""Moved to `sp_harness.cases.frameworks.hf.case` (the step to `.hf.step`); this path is kept for case
files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.hf.case import (
    ACCELERATE_VERSION,
    IGNORE_INDEX,
    TINY_CONFIG,
    TRANSFORMERS_VERSION,
    CausalLMLogits,
    HFTrainerSetup,
    hf_trainer_case,
    hf_trainer_shard,
    shifted_loss_sum,
    shifted_tokens,
    smoothed_shifted_loss_sum,
)
from sp_harness.cases.frameworks.hf.step import TrainerStep, launcher_env

__all__ = ['ACCELERATE_VERSION', 'HFTrainerSetup', 'IGNORE_INDEX', 'TINY_CONFIG', 'TRANSFORMERS_VERSION', 'CausalLMLogits', 'TrainerStep', 'hf_trainer_case', 'hf_trainer_shard', 'launcher_env', 'shifted_loss_sum', 'shifted_tokens', 'smoothed_shifted_loss_sum']
