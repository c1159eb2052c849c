"""Moved to `sp_harness.cases.frameworks.deepspeed.hf`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.deepspeed.hf import MODEL_TYPES, TINY_LLAMA, CausalLMLogits, hf_ulysses_case

__all__ = ['MODEL_TYPES', 'TINY_LLAMA', 'CausalLMLogits', 'hf_ulysses_case']
