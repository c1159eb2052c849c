"""Moved to `sp_harness.cases.frameworks.deepspeed.module`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.deepspeed.module import ModelFactory, ulysses_module_case, ulysses_module_shard

__all__ = ['ModelFactory', 'ulysses_module_case', 'ulysses_module_shard']
