"""Stage: config. A hypothesis strategy for ring-gpt configs (cases/strategies.py's
`sp_gpt_configs`, with a load balancer and the layout the case declares UNSUPPORTED)."""

from __future__ import annotations

from hypothesis import strategies as st

from sp_harness.cases.strategies import sp_gpt_configs
from sp_harness.config.check_config import CheckConfig


def ring_configs(*, case: str = "ring-gpt", min_world_size: int = 1, max_world_size: int = 4,
                 max_dp: int = 2, max_tokens: int = 5, max_heads: int = 4, max_head_dim: int = 4,
                 max_steps: int = 2, include_sbh: bool = True,
                 adversary_choices: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[CheckConfig]:
    """ring-gpt configs: dp x cp meshes, per-rank shards from 0 tokens up (empty and 1-token
    shards, seq_len % 2W anything), or torch.chunk's split of a drawn seq_len; causal or not,
    zigzag or contiguous, grouped-query heads (num_kv_heads dividing num_heads); 'sbh' (which the
    case declares UNSUPPORTED) when `include_sbh`; `adversary_choices` draws the reorder-adversary
    mode (default off)."""
    return sp_gpt_configs(case=case, min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp,
                          max_tokens=max_tokens, max_heads=max_heads, max_head_dim=max_head_dim, max_steps=max_steps,
                          chunk_split=True, load_balancers=("none", "zigzag"), ring_degrees=None,
                          layouts=("bsh", "sbh") if include_sbh else ("bsh",), adversary_choices=adversary_choices)
