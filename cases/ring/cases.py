"""ring-gpt: the reference GPT with context parallelism by ring attention.

Stage: config and step. world_size = dp x cp; the TP group of the engine is the
context-parallel (CP) group. Every parameter is a replicated copy; each rank embeds and runs its
own tokens (contiguous or zigzag, `load_balancer`), attention passes k/v around the ring
(sp_harness.cases.ring.attention). Grads: each rank's loss covers its tokens over the global
token count (the engine's default local loss), so replicated grads are SUMMED over CP, then
averaged over DP.

Supported: any dp x cp mesh, any sequence length and shard sizes (uneven, 1-token and empty
shards; zigzag needs no seq_len % 2W: see placement.py), causal and non-causal, grouped-query
attention, both norms, every dtype. Unsupported: layout 'sbh' (the GPT is [b, s, h]); a
ring_degree other than 1 or cp (no hybrid Ulysses x ring here).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from sp_harness.cases.common import (
    GPT_DEFAULTS,
    IGNORE_INDEX,
    LocalLoss,
    as_gpt,
    attention_of,
    gpt_fields,
    known,
    require_heads,
    require_whole_cp_group,
    sum_replicated_grads,
    with_defaults,
)
from sp_harness.cases.ring.attention import CORRECT, Impl, to_ring
from sp_harness.cases.ring.mappings import Ring
from sp_harness.cases.ring.placement import rank_positions
from sp_harness.cases.train_steps import every_param, with_train_step
from sp_harness.config.case import Case, Example, Layout, Sharded
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import register
from sp_harness.config.step_protocol import TrainLoss

DEFAULTS = dict(GPT_DEFAULTS, load_balancer="zigzag", causal=True)
"""A small GPT; zigzag placement by default (as PyTorch's context_parallel balances by default)."""


def validate(config: CheckConfig) -> None:
    config = with_defaults(config, DEFAULTS)
    require_whole_cp_group(config, "ring-gpt")
    require_heads(config)


def ring_shard(impl: Impl = CORRECT, local_loss: LocalLoss | None = None) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory of ring-gpt built from `impl` (and an optional broken local loss)."""

    def shard(ref: nn.Module, ctx: RankContext) -> Sharded:
        config = with_defaults(ctx.config, DEFAULTS)
        balancer, seq_len = known(config.load_balancer, "load_balancer"), known(config.seq_len, "seq_len")
        order = impl.placement(balancer)
        # the positions the masks are built from: where the placement puts the tokens
        masked_as = order if impl.mask_placement is None else impl.mask_placement(balancer)
        positions = rank_positions(masked_as(seq_len, ctx.seq_shards), ctx.seq_shards)
        ring = Ring(rank=ctx.tp_rank, ranks=ctx.tp_ranks, group=ctx.tp_group, seq_shards=ctx.seq_shards)
        for block in as_gpt(ref).blocks:
            to_ring(attention_of(block), ring=ring, positions=positions, balancer=balancer, seq_len=seq_len,
                    impl=impl)
        layout = Layout(seq_dim=1, batch_dim=0, seq_order=order)
        return Sharded(module=ref, input_layout=layout, output_layout=layout, replicated=("*",),
                       sync_grads=lambda: sum_replicated_grads(ref, ctx), local_loss=local_loss)

    return shard


RING = register(Case(
    name="ring-gpt",
    description="context parallel GPT: ring attention (p2p k/v ring, LSE merge), zigzag or contiguous",
    **gpt_fields(DEFAULTS, positions=True),
    # its own training step: per-token loss over the global valid tokens, grads summed over CP
    shard=with_train_step(ring_shard(), every_param),
    train_loss=TrainLoss(ignore_index=IGNORE_INDEX),
    validate=validate,
    tags=("ring", "context-parallel"),
    examples=(
        Example(fields=(("world_size", 2),), note="even: 12 tokens, zigzag 3+3 per rank"),
        Example(fields=(("world_size", 3), ("seq_len", 10)), note="uneven 4/4/2, 10 % 6 != 0 under zigzag"),
        Example(fields=(("world_size", 4), ("seq_len", 3)), note="1-token and empty shards (1/1/1/0)"),
        Example(fields=(("world_size", 2), ("load_balancer", "none")), note="contiguous causal shards"),
        Example(fields=(("world_size", 3), ("seq_len", 10), ("causal", False)), note="non-causal under zigzag"),
        Example(fields=(("world_size", 2), ("num_kv_heads", 2)), note="grouped-query attention (4 q / 2 kv heads)"),
        Example(fields=(("world_size", 4), ("dp", 2), ("seq_len", 7)), note="2 x 2 dp x cp, 7 tokens 4/3"),
        Example(fields=(("world_size", 2), ("dtype", "bfloat16")), note="bf16 run, float32 LSE merge"),
        Example(fields=(("world_size", 4), ("seq_len", 8), ("prompt_len", 4), ("load_balancer", "none")),
                note="a 4-token prompt: ranks 0 and 1 hold no target tokens"),
        Example(fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 3), ("dtype", "float32")),
                note="its own training step: 3 uneven micro-batches (the last empty, one rank without tokens), "
                     "AdamW, float32"),
    ),
))

__all__ = ["RING", "ring_shard", "CORRECT", "Impl", "validate"]
