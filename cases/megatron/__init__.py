"""Megatron-style tensor + sequence parallel GPT (hand-written collectives, mappings.py style).

megatron/cases.py registers megatron-gpt-ref, megatron-gpt-tp and megatron-gpt-sp.
"""
