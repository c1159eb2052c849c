"""Stage: config. The hypothesis strategy the sequence-parallel GPT cases share.

In the style of sp_harness.config.strategies: keyword-only bounds, validated before any draw,
valid values built directly (shards drawn rank by rank or torch.chunk's split of a drawn length,
hidden = heads x head_dim, k/v heads among the divisors of the head count). Shrinks toward one
rank, even one-token shards, one head, causal, no load balancer, [b, s, h], float64. Each case's
module (ring/strategies.py, ...) fixes what its case takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from hypothesis import strategies as st

from sp_harness.config.check_config import Adversary, CheckConfig, DType
from sp_harness.config.gpt_knobs import Norm
from sp_harness.config.strategies import dtypes, meshes, norms, seeds, shard_sizes


def sp_gpt_configs(*, case: str, min_world_size: int, max_world_size: int, max_dp: int, max_tokens: int,
                   min_heads: int = 1, max_heads: int, max_head_dim: int, max_steps: int, chunk_split: bool,
                   load_balancers: Sequence[str] | None, ring_degrees: Callable[[int], list[int | None]] | None,
                   layouts: Sequence[str],
                   adversary_choices: st.SearchStrategy[str] | None) -> st.SearchStrategy[CheckConfig]:
    """GPT configs on a dp x sp mesh: per-rank shards of 0..max_tokens tokens (empty and
    one-token ranks occur), or with `chunk_split` as often torch.chunk's split of a drawn
    seq_len; num_heads min..max_heads with any dividing num_kv_heads; causal or not; a load
    balancer among `load_balancers` (None: the field left unset); a ring degree among
    `ring_degrees(sp)` (None: unset); a layout among `layouts`; every dtype; `adversary_choices`
    draws the reorder-adversary mode (None: off)."""
    if not 1 <= min_world_size <= max_world_size:
        raise ValueError(f"need 1 <= min_world_size <= max_world_size, got {min_world_size}, {max_world_size}")
    if not 1 <= min_heads <= max_heads:
        raise ValueError(f"need 1 <= min_heads <= max_heads, got {min_heads}, {max_heads}")
    for label, value in (("max_dp", max_dp), ("max_tokens", max_tokens), ("max_head_dim", max_head_dim),
                         ("max_steps", max_steps)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if not layouts:
        raise ValueError("layouts must name at least one layout")

    @st.composite
    def build(draw: st.DrawFn) -> CheckConfig:
        dp, sp = draw(meshes(min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp))
        ring_degree = draw(st.sampled_from(ring_degrees(sp))) if ring_degrees is not None else None
        seq_shards: tuple[int, ...] | None
        if chunk_split and draw(st.booleans()):
            seq_shards = None
            seq_len = draw(st.integers(1, max_tokens * sp))
        else:
            seq_shards = draw(shard_sizes(num_ranks=sp, min_tokens=0, max_tokens=max_tokens))
            seq_len = sum(seq_shards)
        num_heads = draw(st.integers(min_heads, max_heads))
        num_kv_heads = draw(st.sampled_from([d for d in range(num_heads, 0, -1) if num_heads % d == 0]))
        # hidden >= 3: see gpt_configs (a LayerNorm over 1-2 features has a constant output)
        head_dim = draw(st.integers(max(1, -(-3 // num_heads)), max(max_head_dim, -(-3 // num_heads))))
        return CheckConfig(
            case=case, world_size=dp * sp, dp=dp, seq_len=seq_len, seq_shards=seq_shards, ring_degree=ring_degree,
            batch=draw(st.integers(1, 2)), hidden=num_heads * head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
            prompt_len=draw(st.integers(0, max(0, seq_len - 1))),  # 0 first: shrinks to no prompt
            causal=draw(st.sampled_from([True, False])),
            load_balancer=draw(st.sampled_from(load_balancers)) if load_balancers is not None else None,
            ffn=draw(st.integers(1, 16)), num_layers=draw(st.integers(1, 2)), vocab=draw(st.integers(2, 16)),
            # norms() and dtypes() draw from NORMS and DTYPES, the literals' own values; the
            # adversary strategy's draws are modes the caller names (config.strategies.adversaries)
            norm=cast(Norm, draw(norms())), layout=draw(st.sampled_from(list(layouts))),
            dtype=cast(DType, draw(dtypes())), steps=draw(st.integers(1, max_steps)), seed=draw(seeds()),
            adversary=cast(Adversary, draw(adversary_choices)) if adversary_choices is not None else "off",
        )

    return build()
