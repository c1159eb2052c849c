"""usp-gpt: Unified Sequence Parallelism (Ulysses x ring) on the reference GPT.

Stage: config and step. world_size = dp x sp, the engine's TP group is the SP
group, factored as sp = ulysses_degree x ring_degree (`ring_degree`; default 2 where 2 divides
sp, else 1). Each block's attention: all-to-all seq->heads in the Ulysses group, ring attention
(p2p k/v ring, LSE merge) across the ring group over each Ulysses group's combined tokens,
all-to-all back (sp_harness.cases.usp.model). Grads: each rank's loss covers its tokens over the
global count (the engine's default local loss), so replicated grads are SUMMED over SP, then
averaged over DP.

Supported: any dp x sp mesh with ring_degree dividing sp; uneven sequence shards, 1-token and
empty shards (the all-to-all takes per-rank split sizes, the ring per-group block lengths);
uneven head splits over the Ulysses group, more Ulysses ranks than heads included; grouped-query
attention with any num_kv_heads dividing num_heads; causal or not; zigzag over the ring
dimension (load_balancer 'zigzag': usp/placement.py) or contiguous; both norms; every dtype.
Unsupported (declared, with the numbers): layout 'sbh' (the GPT is [b, s, h]); a ring_degree
that does not divide sp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from sp_harness.cases.common import GPT_DEFAULTS, as_gpt, gpt_fields, require_bsh, require_heads
from sp_harness.cases.usp.groups import make_grid
from sp_harness.cases.usp.model import CORRECT, Impl, build_sharded
from sp_harness.config.case import Case, Example, Sharded, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import register

DEFAULTS = dict(GPT_DEFAULTS, num_kv_heads=2, load_balancer="zigzag", causal=True)
"""A small GPT: 4 query heads sharing 2 k/v heads, zigzag over the ring (as yunchang's
LongContextAttention and TransformerEngine's a2a+p2p balance by default)."""


def default_ring_degree(sp: int) -> int:
    """2 where it divides sp (the smallest real hybrid at sp = 4: 2 x 2), else 1 (pure Ulysses)."""
    return 2 if sp % 2 == 0 else 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class USPCase(Case):
    """A Case whose ring_degree default depends on the SP size (a plain `defaults` dict cannot)."""

    def resolve(self, config: CheckConfig) -> CheckConfig:
        if config.ring_degree is None and config.world_size and config.dp:
            config = config.replace(ring_degree=default_ring_degree(config.world_size // config.dp))
        return super().resolve(config)


def validate(config: CheckConfig) -> None:
    require_heads(config)
    require_bsh(config, "usp-gpt")
    sp, ring = config.tp, config.ring_degree or default_ring_degree(config.tp)
    if sp % ring:
        raise Unsupported(f"ring_degree({ring}) does not divide sp({sp}) = world_size({config.world_size}) / "
                          f"dp({config.dp})")


def usp_shard(impl: Impl = CORRECT) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory of usp-gpt built from `impl`."""

    def shard(ref: nn.Module, ctx: RankContext) -> Sharded:
        grid = make_grid(ctx, ctx.config.ring_degree or default_ring_degree(ctx.tp))
        return build_sharded(as_gpt(ref), ctx, grid, impl)

    return shard


USP = register(USPCase(
    name="usp-gpt",
    description="USP hybrid GPT: Ulysses all-to-all inside ring attention (a2a+p2p), zigzag over the ring",
    **gpt_fields(DEFAULTS, positions=True),
    shard=usp_shard(),
    validate=validate,
    tags=("usp", "ulysses", "ring"),
    examples=(
        Example(fields=(("world_size", 4),), note="2 x 2 (Ulysses x ring): 12 tokens 3/3/3/3, zigzag over the ring"),
        Example(fields=(("world_size", 4), ("seq_len", 11)), note="2 x 2 uneven: 11 tokens 3/3/3/2, groups 6/5"),
        Example(fields=(("world_size", 4), ("num_kv_heads", 1), ("causal", False)),
                note="2 x 2 non-causal, MQA: one k/v head for both Ulysses ranks"),
        Example(fields=(("world_size", 3), ("seq_len", 10)), note="sp 3: ring_degree 1, pure Ulysses 4/4/2"),
    ),
))

__all__ = ["USP", "usp_shard", "CORRECT", "Impl", "validate", "default_ring_degree"]
