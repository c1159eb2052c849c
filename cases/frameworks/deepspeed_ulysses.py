"""Moved to `sp_harness.cases.frameworks.deepspeed.case`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.deepspeed.case import (
    ZERO3_UNSUPPORTED,
    check_engine_args,
    detached,
    engine_limits,
    grad_sync_of,
    sdpa_attention,
    ulysses_case,
    ulysses_limits,
    ulysses_shard,
    zero_stage,
)

# CausalLMLogits lived here until the HF models' module split (ab3262d)
from sp_harness.cases.frameworks.deepspeed.hf import CausalLMLogits

__all__ = ['ZERO3_UNSUPPORTED', 'check_engine_args', 'engine_limits', 'detached', 'grad_sync_of', 'sdpa_attention', 'ulysses_case', 'ulysses_limits', 'ulysses_shard', 'zero_stage', 'CausalLMLogits']
