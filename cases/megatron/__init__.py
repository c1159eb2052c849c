"""Megatron-style tensor + sequence parallel GPT (hand-written collectives). Placeholder."""
