"""Megatron-style tensor + sequence parallel GPT (hand-written collectives, mappings.py style).

Importing this package registers megatron-gpt-ref, megatron-gpt-tp and megatron-gpt-sp.
"""

from cases.megatron import cases  # noqa: F401
