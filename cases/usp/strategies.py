"""Hypothesis strategies for usp-gpt configs (the style of sp_harness.config.strategies: plural
nouns, keyword-only validated bounds, valid values built directly, shrinking toward few ranks,
even one-token shards, causal, no load balancer, float64)."""

from __future__ import annotations

from hypothesis import strategies as st

from sp_harness.config.check_config import CheckConfig
from sp_harness.config.strategies import dtypes, meshes, norms, seeds, shard_sizes


def usp_configs(*, case: str = "usp-gpt", min_world_size: int = 1, max_world_size: int = 4,
                max_dp: int = 2, max_tokens: int = 5, max_heads: int = 4, max_head_dim: int = 4,
                max_steps: int = 2, include_unsupported: bool = True,
                adversary_choices: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[CheckConfig]:
    """usp-gpt configs: dp x sp meshes, a ring_degree dividing sp (or the case's default), per-rank
    shards from 0 tokens up or torch.chunk's split of a drawn seq_len; causal or not, zigzag or
    contiguous, grouped-query heads (num_kv_heads dividing num_heads); with `include_unsupported`
    also 'sbh' and ring degrees that do not divide sp (which the case declares UNSUPPORTED);
    `adversary_choices` draws the reorder-adversary mode (default off)."""
    if not 1 <= min_world_size <= max_world_size:
        raise ValueError(f"need 1 <= min_world_size <= max_world_size, got {min_world_size}, {max_world_size}")
    for label, value in (("max_dp", max_dp), ("max_tokens", max_tokens), ("max_heads", max_heads),
                         ("max_head_dim", max_head_dim), ("max_steps", max_steps)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    return _usp_configs(case, min_world_size, max_world_size, max_dp, max_tokens, max_heads, max_head_dim,
                        max_steps, include_unsupported, adversary_choices)


@st.composite
def _usp_configs(draw, case, min_world_size, max_world_size, max_dp, max_tokens, max_heads, max_head_dim,
                 max_steps, include_unsupported, adversary_choices) -> CheckConfig:
    dp, sp = draw(meshes(min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp))
    degrees = [None] + [r for r in range(1, sp + 1) if sp % r == 0]
    if include_unsupported:
        degrees += [r for r in range(2, sp + 2) if sp % r]
    ring_degree = draw(st.sampled_from(degrees))
    if draw(st.booleans()):
        seq_shards = None
        seq_len = draw(st.integers(1, max_tokens * sp))
    else:
        seq_shards = draw(shard_sizes(num_ranks=sp, min_tokens=0, max_tokens=max_tokens))
        seq_len = sum(seq_shards)
    num_heads = draw(st.integers(1, max_heads))
    num_kv_heads = draw(st.sampled_from([d for d in range(num_heads, 0, -1) if num_heads % d == 0]))
    # hidden >= 3: see gpt_configs (a LayerNorm over 1-2 features has a constant output)
    head_dim = draw(st.integers(max(1, -(-3 // num_heads)), max(max_head_dim, -(-3 // num_heads))))
    return CheckConfig(
        case=case, world_size=dp * sp, dp=dp, seq_len=seq_len, seq_shards=seq_shards, ring_degree=ring_degree,
        batch=draw(st.integers(1, 2)), hidden=num_heads * head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
        prompt_len=draw(st.integers(0, max(0, seq_len - 1))),  # 0 first: shrinks to no prompt
        causal=draw(st.sampled_from([True, False])), load_balancer=draw(st.sampled_from(["none", "zigzag"])),
        ffn=draw(st.integers(1, 16)), num_layers=draw(st.integers(1, 2)), vocab=draw(st.integers(2, 16)),
        norm=draw(norms()), layout=draw(st.sampled_from(["bsh", "sbh"] if include_unsupported else ["bsh"])),
        dtype=draw(dtypes()), steps=draw(st.integers(1, max_steps)), seed=draw(seeds()),
        adversary=draw(adversary_choices) if adversary_choices is not None else "off",
    )
