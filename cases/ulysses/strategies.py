"""Stage: config (generated). A hypothesis strategy for ulysses-gpt configs.

In the style of sp_harness.config.strategies: a plural noun with keyword-only bounds, validated,
building valid values directly (shards drawn rank by rank, hidden = heads x head_dim, k/v heads
drawn among the divisors of the head count). Shrinks toward one rank, one token per rank, one
head, causal, [b, s, h], float64.
"""

from __future__ import annotations

from hypothesis import strategies as st

from sp_harness.config.check_config import CheckConfig
from sp_harness.config.strategies import layouts, meshes, norms, seeds, shard_sizes


def _bounds(**pairs: tuple[int, int]) -> None:
    for name, (lo, hi) in pairs.items():
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= min_{name} <= max_{name}, got {lo} and {hi}")


def ulysses_configs(*, case: str = "ulysses-gpt", min_world_size: int = 1, max_world_size: int = 4,
                    max_dp: int = 2, max_tokens: int = 4, min_heads: int = 1, max_heads: int = 6,
                    max_head_dim: int = 4, max_steps: int = 2,
                    adversary_choices: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[CheckConfig]:
    """CheckConfigs for ulysses-gpt: world size min..max_world_size as dp x sp, per-rank shards of
    0..max_tokens tokens (empty and one-token ranks occur), num_heads min..max_heads with any
    dividing num_kv_heads (fewer k/v heads than ranks occurs), causal or not, and both layouts
    ('sbh' is the case's declared UNSUPPORTED); `adversary_choices` draws the reorder-adversary
    mode (default off). Bounds are checked here, before any draw."""
    _bounds(world_size=(min_world_size, max_world_size), heads=(min_heads, max_heads),
            head_dim=(1, max_head_dim), steps=(1, max_steps), dp=(1, max_dp))
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return _ulysses_configs(case, min_world_size, max_world_size, max_dp, max_tokens, min_heads, max_heads,
                            max_head_dim, max_steps, adversary_choices)


@st.composite
def _ulysses_configs(draw, case, min_world_size, max_world_size, max_dp, max_tokens, min_heads, max_heads,
                     max_head_dim, max_steps, adversary_choices) -> CheckConfig:
    dp, sp = draw(meshes(min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp))
    seq_shards = draw(shard_sizes(num_ranks=sp, min_tokens=0, max_tokens=max_tokens))
    num_heads = draw(st.integers(min_heads, max_heads))
    num_kv_heads = draw(st.sampled_from([k for k in range(num_heads, 0, -1) if num_heads % k == 0]))
    # hidden >= 3: a LayerNorm over 1 or 2 features has a constant output (see gpt_configs)
    head_dim = draw(st.integers(max(1, -(-3 // num_heads)), max(max_head_dim, -(-3 // num_heads))))
    return CheckConfig(
        case=case, world_size=dp * sp, dp=dp, seq_len=sum(seq_shards), seq_shards=seq_shards,
        batch=draw(st.integers(1, 2)), hidden=num_heads * head_dim, num_heads=num_heads,
        prompt_len=draw(st.integers(0, max(0, sum(seq_shards) - 1))),  # 0 first: shrinks to no prompt
        num_kv_heads=num_kv_heads, causal=draw(st.booleans().map(lambda b: not b)),
        ffn=draw(st.integers(1, 16)), num_layers=draw(st.integers(1, 2)), vocab=draw(st.integers(2, 16)),
        norm=draw(norms()), layout=draw(layouts()), dtype=draw(st.sampled_from(["float64", "float32"])),
        steps=draw(st.integers(1, max_steps)), seed=draw(seeds()),
        adversary=draw(adversary_choices) if adversary_choices is not None else "off",
    )
