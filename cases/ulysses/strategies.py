"""Stage: config. A hypothesis strategy for ulysses-gpt configs (cases/strategies.py's
`sp_gpt_configs`: shards always drawn rank by rank, no load balancer, both layouts)."""

from __future__ import annotations

from hypothesis import strategies as st

from sp_harness.cases.strategies import sp_gpt_configs
from sp_harness.config.check_config import CheckConfig


def ulysses_configs(*, case: str = "ulysses-gpt", min_world_size: int = 1, max_world_size: int = 4,
                    max_dp: int = 2, max_tokens: int = 4, min_heads: int = 1, max_heads: int = 6,
                    max_head_dim: int = 4, max_steps: int = 2,
                    adversary_choices: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[CheckConfig]:
    """CheckConfigs for ulysses-gpt: world size min..max_world_size as dp x sp, per-rank shards of
    0..max_tokens tokens (empty and one-token ranks occur), num_heads min..max_heads with any
    dividing num_kv_heads (fewer k/v heads than ranks occurs), causal or not, every dtype, and both
    layouts ('sbh' is the case's declared UNSUPPORTED); `adversary_choices` draws the
    reorder-adversary mode (default off). Bounds are checked here, before any draw."""
    return sp_gpt_configs(case=case, min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp,
                          max_tokens=max_tokens, min_heads=min_heads, max_heads=max_heads, max_head_dim=max_head_dim,
                          max_steps=max_steps, chunk_split=False, load_balancers=None, ring_degrees=None,
                          layouts=("bsh", "sbh"), adversary_choices=adversary_choices)
