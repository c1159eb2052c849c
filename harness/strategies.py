"""Stage: config (generated). Public hypothesis strategies for sequence-parallel configs.

Strategies are plural nouns with keyword-only `min_*`/`max_*` bounds, and they build valid
values directly instead of filtering: per-rank sequence shards are drawn rank by rank and summed
into the sequence length, hidden sizes are drawn as heads x head_dim, the mesh as dp x tp. Every
draw shrinks toward its lower bound and the first listed choice, so a failure shrinks toward few
ranks, one token per rank (even), float64, layernorm, one step, seed 0; what remains uneven in
the minimal example is what the bug needs.
"""

from __future__ import annotations

from hypothesis import strategies as st

from harness.config import CheckConfig


def world_sizes(*, min_size: int = 1, max_size: int = 8) -> st.SearchStrategy[int]:
    if not 1 <= min_size <= max_size:
        raise ValueError(f"need 1 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")
    return st.integers(min_size, max_size)


def meshes(*, min_world_size: int = 1, max_world_size: int = 8, max_dp: int = 1) -> st.SearchStrategy[tuple[int, int]]:
    """(dp, tp) pairs with dp * tp in bounds; dp shrinks to 1."""

    @st.composite
    def build(draw):
        tp = draw(st.integers(1, max_world_size))
        dp_max = max(1, min(max_dp, max_world_size // tp))
        dp = draw(st.integers(1, dp_max))
        if dp * tp < min_world_size:
            # build valid: raise tp rather than reject the draw
            tp = -(-min_world_size // dp)
        return dp, tp

    return build()


def shard_sizes(*, num_ranks: int, min_tokens: int = 1, max_tokens: int = 6) -> st.SearchStrategy[tuple[int, ...]]:
    """Tokens per rank, drawn per rank: uneven splits, one-token ranks and (min_tokens=0) empty
    ranks all occur; shrinks toward min_tokens everywhere (an even split)."""
    if num_ranks < 1 or not 0 <= min_tokens <= max_tokens:
        raise ValueError(f"need num_ranks >= 1 and 0 <= min_tokens <= max_tokens, got {num_ranks}, {min_tokens}, {max_tokens}")
    per_rank = st.integers(min_tokens, max_tokens)
    sizes = st.tuples(*[per_rank] * num_ranks)
    return sizes.map(lambda s: s if sum(s) else (1,) + s[1:])  # at least one token in all


def head_counts(*, min_heads: int = 1, max_heads: int = 8) -> st.SearchStrategy[int]:
    return st.integers(min_heads, max_heads)


def widths(*, min_width: int = 1, max_width: int = 64) -> st.SearchStrategy[int]:
    return st.integers(min_width, max_width)


def dtypes(*, include_bfloat16: bool = True) -> st.SearchStrategy[str]:
    return st.sampled_from(["float64", "float32"] + (["bfloat16"] if include_bfloat16 else []))


def norms() -> st.SearchStrategy[str]:
    return st.sampled_from(["layernorm", "rmsnorm"])


def layouts() -> st.SearchStrategy[str]:
    return st.sampled_from(["bsh", "sbh"])


def seeds(*, max_seed: int = 2**16) -> st.SearchStrategy[int]:
    return st.integers(0, max_seed)


def step_counts(*, min_steps: int = 1, max_steps: int = 3) -> st.SearchStrategy[int]:
    return st.integers(min_steps, max_steps)


@st.composite
def gpt_configs(draw, case: str, *, min_world_size: int = 1, max_world_size: int = 4, max_dp: int = 2,
                min_tokens: int = 0, max_tokens: int = 5, max_heads: int = 6, max_head_dim: int = 6,
                chunk_only: bool = False, dtype_choices=None, max_steps: int = 2) -> CheckConfig:
    """CheckConfigs for a GPT case. `chunk_only`: draw seq_len and let torch.chunk split it (for
    DTensor plans, which can split no other way) instead of per-rank shard sizes."""
    dp, tp = draw(meshes(min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp))
    num_heads = draw(head_counts(min_heads=1, max_heads=max_heads))
    head_dim = draw(st.integers(1, max_head_dim))
    if chunk_only:
        seq_len = draw(st.integers(1, max_tokens * tp))
        seq_shards = None
    else:
        seq_shards = draw(shard_sizes(num_ranks=tp, min_tokens=min_tokens, max_tokens=max_tokens))
        seq_len = sum(seq_shards)
    return CheckConfig(
        case=case, world_size=dp * tp, dp=dp, seq_len=seq_len, seq_shards=seq_shards,
        batch=draw(st.integers(1, 2)), hidden=num_heads * head_dim, num_heads=num_heads,
        ffn=draw(widths(min_width=1, max_width=24)), num_layers=draw(st.integers(1, 2)),
        vocab=draw(st.integers(2, 24)), norm=draw(norms()), layout=draw(layouts()),
        dtype=draw(dtype_choices if dtype_choices is not None else dtypes()), steps=draw(step_counts(max_steps=max_steps)),
        seed=draw(seeds()),
    )


@st.composite
def mlp_configs(draw, case: str = "seed-mlp", *, min_world_size: int = 1, max_world_size: int = 4,
                max_tokens: int = 5, dtype_choices=None, max_steps: int = 2) -> CheckConfig:
    """CheckConfigs for the seed MLP: hidden widths not divisible by the world size occur."""
    tp = draw(world_sizes(min_size=min_world_size, max_size=max_world_size))
    return CheckConfig(
        case=case, world_size=tp, seq_len=draw(st.integers(1, max_tokens * tp)),
        hidden=draw(widths(min_width=1, max_width=40)),
        dtype=draw(dtype_choices if dtype_choices is not None else dtypes()), steps=draw(step_counts(max_steps=max_steps)),
        seed=draw(seeds()),
    )
