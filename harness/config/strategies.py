"""Stage: config. Public hypothesis strategies for sequence-parallel configs.

Strategies are plural nouns with keyword-only `min_*`/`max_*` bounds, and they build valid
values directly instead of filtering: per-rank sequence shards are drawn rank by rank and summed
into the sequence length, hidden sizes are drawn as heads x head_dim, the mesh as dp x tp. Every
draw shrinks toward its lower bound and the first listed choice, so a failure shrinks toward few
ranks, one token per rank (even), float64, layernorm, one step, seed 0; what remains uneven in
the minimal example is what the bug needs.
"""

from __future__ import annotations

from hypothesis import strategies as st

from sp_harness.config.check_config import ADVERSARIES, DTYPES, CheckConfig
from sp_harness.config.flags import specs
from sp_harness.config.gpt_knobs import LAYOUTS, NORMS


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
    return st.sampled_from([d for d in DTYPES if include_bfloat16 or d != "bfloat16"])


def norms() -> st.SearchStrategy[str]:
    return st.sampled_from(NORMS)


def layouts() -> st.SearchStrategy[str]:
    return st.sampled_from(LAYOUTS)


def knob_values(knobs: type, *, max_value: int = 8, **fields: st.SearchStrategy) -> st.SearchStrategy:
    """Instances of a knob class (`Case.knobs`) drawn from its declarations: choices from a
    Literal, yes/no from a bool, whole numbers from the declared minimum up to `max_value`;
    `fields` overrides a field's strategy. Each shrinks toward its first choice or its minimum."""
    drawn = {}
    for s in specs(knobs):
        if s.name in fields:
            drawn[s.name] = fields[s.name]
        elif s.choices is not None:
            drawn[s.name] = st.sampled_from(s.choices)
        elif s.kind is bool:
            drawn[s.name] = st.booleans()
        elif s.kind is int:
            low = int(s.flag.min) if s.flag.min is not None else 0
            drawn[s.name] = st.integers(low, max(low, max_value))
    return st.builds(knobs, **drawn)


def seeds(*, max_seed: int = 2**16) -> st.SearchStrategy[int]:
    return st.integers(0, max_seed)


def adversaries(*, include_off: bool = False) -> st.SearchStrategy[str]:
    """Reorder-adversary modes (sp_harness.step.adversary); shrinks toward the first listed."""
    return st.sampled_from(ADVERSARIES if include_off else ADVERSARIES[1:])


def step_counts(*, min_steps: int = 1, max_steps: int = 3) -> st.SearchStrategy[int]:
    return st.integers(min_steps, max_steps)


@st.composite
def gpt_configs(draw, case: str, *, min_world_size: int = 1, max_world_size: int = 4, max_dp: int = 2,
                min_tokens: int = 0, max_tokens: int = 5, max_heads: int = 6, max_head_dim: int = 6,
                chunk_only: bool = False, dtype_choices=None, max_steps: int = 2, max_hidden: int | None = None,
                max_ffn: int = 24, max_layers: int = 2, max_vocab: int = 24,
                adversary_choices: st.SearchStrategy[str] | None = None, min_hidden: int = 3) -> CheckConfig:
    """CheckConfigs for a GPT case. `chunk_only`: draw seq_len and let torch.chunk split it (for
    DTensor plans, which can split no other way) instead of per-rank shard sizes. `max_hidden`
    caps num_heads * head_dim; `adversary_choices` draws the reorder-adversary mode (default off).
    `realistic_gpt_configs` sets these bounds to training-like sizes."""
    for label, value in (("max_ffn", max_ffn), ("max_layers", max_layers), ("max_vocab", max_vocab - 1)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    dp, tp = draw(meshes(min_world_size=min_world_size, max_world_size=max_world_size, max_dp=max_dp))
    num_heads = draw(head_counts(min_heads=1, max_heads=max_heads))
    head_cap = max_head_dim if max_hidden is None else max(1, min(max_head_dim, max_hidden // num_heads))
    # hidden >= 3: a LayerNorm over one or two features has a constant output (0, or +-1), so
    # every grad upstream of it is mathematically zero and numerically rounding noise amplified
    # by 1/sqrt(norm eps) = 316, judged against noise (the reorder adversary found 9x and 14x
    # "mismatches" between two noises at hidden 1 and 2)
    head_dim = draw(st.integers(max(1, -(-min_hidden // num_heads)), max(head_cap, -(-min_hidden // num_heads))))
    if chunk_only:
        seq_len = draw(st.integers(1, max_tokens * tp))
        seq_shards = None
    else:
        seq_shards = draw(shard_sizes(num_ranks=tp, min_tokens=min_tokens, max_tokens=max_tokens))
        seq_len = sum(seq_shards)
    return CheckConfig(
        case=case, world_size=dp * tp, dp=dp, seq_len=seq_len, seq_shards=seq_shards,
        batch=draw(st.integers(1, 2)), hidden=num_heads * head_dim, num_heads=num_heads,
        ffn=draw(widths(min_width=1, max_width=max_ffn)), num_layers=draw(st.integers(1, max_layers)),
        vocab=draw(st.integers(2, max_vocab)), norm=draw(norms()), layout=draw(layouts()),
        dtype=draw(dtype_choices if dtype_choices is not None else dtypes()), steps=draw(step_counts(max_steps=max_steps)),
        seed=draw(seeds()), adversary=draw(adversary_choices) if adversary_choices is not None else "off",
    )


@st.composite
def train_step_configs(draw, case: str, *, max_world_size: int = 4, max_micro_batches: int = 4,
                       dtype_choices=None, bsh_only: bool = False) -> CheckConfig:
    """CheckConfigs of the training-step check for a GPT case that declares a step: a small GPT
    config (`gpt_configs`, at least 2 tokens per rank so the masks have room), K micro-batches
    (1..max_micro_batches), SGD or AdamW, clipping off or forced active (a max norm far below any
    of these models' grad norms). `bsh_only`: layout 'bsh' always (a case that runs no other)."""
    if max_micro_batches < 1:
        raise ValueError(f"max_micro_batches must be >= 1, got {max_micro_batches}")
    config = draw(gpt_configs(case, max_world_size=max_world_size, min_tokens=2, max_tokens=4, max_hidden=16,
                              dtype_choices=dtype_choices))
    if bsh_only:
        config = config.replace(layout="bsh")
    return config.replace(train_step=True, micro_batches=draw(st.integers(1, max_micro_batches)),
                          optimizer=draw(st.sampled_from(("sgd", "adamw"))),
                          clip_grad_norm=draw(st.sampled_from((None, 1e-3))))


def realistic_gpt_configs(case: str, *, max_world_size: int = 4, max_dp: int = 2, chunk_only: bool = False,
                          dtype_choices=None, adversary_choices=None) -> st.SearchStrategy[CheckConfig]:
    """GPT configs at training-like sizes: hidden up to 256 (8 heads of up to 32), sequences up
    to 512 tokens, ffn up to 1024, up to 4 layers and 5 AdamW steps, vocab up to 256."""
    tp_max = max_world_size
    return gpt_configs(case, max_world_size=max_world_size, max_dp=max_dp, min_tokens=0, max_tokens=512 // tp_max,
                       max_heads=8, max_head_dim=32, max_hidden=256, chunk_only=chunk_only,
                       dtype_choices=dtype_choices, max_steps=5, max_ffn=1024, max_layers=4, max_vocab=256,
                       adversary_choices=adversary_choices)


def training_sized_configs(configs: st.SearchStrategy[CheckConfig], *, min_tokens: int = 256, max_tokens: int = 512,
                           max_layers: int = 3, max_steps: int = 3) -> st.SearchStrategy[CheckConfig]:
    """Draws of `configs` (their case, mesh, dtype, adversary, layout, balancer as drawn) at a
    training-like size: hidden 256 (8 heads of 32), or 384 (12 heads) where the sequence-parallel
    degree is a multiple of 3, so heads split over it; ffn 4 x hidden; vocab 256; `min_tokens` to
    `max_tokens` tokens per sequence, split by torch.chunk; 2 to `max_layers` layers and 1 to
    `max_steps` steps. What the small draw made uneven (shards, head counts) is replaced: this is
    for the false-alarm rate at the sizes users train at (docs/false-alarms.md), not for shrinking."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}")
    if max_layers < 2 or max_steps < 1:
        raise ValueError(f"need max_layers >= 2 and max_steps >= 1, got max_layers={max_layers}, max_steps={max_steps}")

    @st.composite
    def build(draw):
        config = draw(configs)
        num_heads = 12 if (config.world_size // config.dp) % 3 == 0 else 8
        hidden = 32 * num_heads
        return config.replace(hidden=hidden, ffn=4 * hidden, num_heads=num_heads, num_kv_heads=None, vocab=256,
                              seq_len=draw(st.integers(min_tokens, max_tokens)), seq_shards=None,
                              num_layers=draw(st.integers(2, max_layers)), steps=draw(step_counts(max_steps=max_steps)))

    return build()


@st.composite
def mlp_configs(draw, case: str = "seed-mlp", *, min_world_size: int = 1, max_world_size: int = 4,
                max_tokens: int = 5, dtype_choices=None, max_steps: int = 2, max_hidden: int = 40,
                adversary_choices: st.SearchStrategy[str] | None = None) -> CheckConfig:
    """CheckConfigs for the seed MLP: hidden widths not divisible by the world size occur."""
    tp = draw(world_sizes(min_size=min_world_size, max_size=max_world_size))
    return CheckConfig(
        case=case, world_size=tp, seq_len=draw(st.integers(1, max_tokens * tp)),
        hidden=draw(widths(min_width=1, max_width=max_hidden)),
        dtype=draw(dtype_choices if dtype_choices is not None else dtypes()), steps=draw(step_counts(max_steps=max_steps)),
        seed=draw(seeds()), adversary=draw(adversary_choices) if adversary_choices is not None else "off",
    )
