"""Megatron-style tensor + sequence parallel GPT (hand-written collectives, mappings.py style).

Importing this package registers megatron-gpt-ref, megatron-gpt-tp and megatron-gpt-sp.
"""

from sp_harness.cases.megatron import cases  # noqa: F401
