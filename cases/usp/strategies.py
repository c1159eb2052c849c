"""Stage: config. A hypothesis strategy for usp-gpt configs (cases/strategies.py's
`sp_gpt_configs`, with a ring degree, a load balancer and what the case declares UNSUPPORTED)."""

from __future__ import annotations

from hypothesis import strategies as st

from sp_harness.cases.strategies import sp_gpt_configs
from sp_harness.config.check_config import CheckConfig


def usp_configs(*, case: str = "usp-gpt", min_world_size: int = 1, max_world_size: int = 4,
                max_dp: int = 2, max_tokens: int = 5, max_heads: int = 4, max_head_dim: int = 4,
                max_steps: int = 2, include_unsupported: bool = True,
                adversary_choices: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[CheckConfig]:
    """usp-gpt configs: dp x sp meshes, a ring_degree dividing sp (or the case's default), per-rank
    shards from 0 tokens up or torch.chunk's split of a drawn seq_len; causal or not, zigzag or
    contiguous, grouped-query heads (num_kv_heads dividing num_heads); with `include_unsupported`
    also 'sbh' and ring degrees that do not divide sp (which the case declares UNSUPPORTED);
    `adversary_choices` draws the reorder-adversary mode (default off)."""

    def ring_degrees(sp: int) -> list[int | None]:
        degrees: list[int | None] = [None, *(r for r in range(1, sp + 1) if sp % r == 0)]
        return degrees + [r for r in range(2, sp + 2) if sp % r] if include_unsupported else degrees

    return sp_gpt_configs(case=case, min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp,
                          max_tokens=max_tokens, max_heads=max_heads, max_head_dim=max_head_dim, max_steps=max_steps,
                          chunk_split=True, load_balancers=("none", "zigzag"), ring_degrees=ring_degrees,
                          layouts=("bsh", "sbh") if include_unsupported else ("bsh",),
                          adversary_choices=adversary_choices)
