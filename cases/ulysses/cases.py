"""ulysses-gpt: DeepSpeed-Ulysses all-to-all sequence parallelism on the reference GPT.

Stage: config and step. `ulysses_shard(impl)` is the sharded factory built from
an `Impl`; mutants swap one piece of `CORRECT`.

Supported: any dp x sp mesh (world_size = dp x sp; the SP group is the engine's TP group); uneven
sequence shards (torch.chunk's split or explicit seq_shards), including ranks with one token or
none; uneven heads (balanced: 4 heads over 3 ranks are 2/1/1; more ranks than heads leaves
ranks with no heads, which still take part in every all-to-all); grouped-query attention with
any num_kv_heads dividing num_heads, fewer k/v heads than ranks included (each rank is sent the
k/v heads its query heads need; one k/v head may go to several ranks); causal or not; both norms.
Unsupported (declared by `validate`, with the numbers): layout 'sbh' (activations are [b, s, h]
only), load_balancer other than 'none' (contiguous shards only), ring_degree other than 1 (no
ring inside; a hybrid case would be another case).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from sp_harness.cases.common import GPT_DEFAULTS, as_gpt, gpt_fields, require_bsh, require_heads
from sp_harness.cases.ulysses.model import CORRECT, Impl, build_sharded
from sp_harness.config.case import Case, Example, Sharded, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import register

DEFAULTS = dict(GPT_DEFAULTS, num_kv_heads=2)
"""A small GPT: 4 query heads sharing 2 k/v heads (GQA by default, so the default battery's
3-rank entry already has fewer k/v heads than ranks: 2/1/1 query heads need k/v heads 0/1/1)."""


def validate(config: CheckConfig) -> None:
    require_heads(config)
    require_bsh(config, "ulysses-gpt")
    if config.load_balancer not in (None, "none"):
        raise Unsupported(f"ulysses-gpt shards the sequence contiguously: load_balancer {config.load_balancer!r} "
                          f"asked (a causal load balancer is a ring-attention concern)")
    if config.ring_degree not in (None, 1):
        raise Unsupported(f"ulysses-gpt is pure Ulysses: ring_degree({config.ring_degree}) asked, needs 1 "
                          f"(sp = {config.tp} ranks all in the all-to-all)")


def ulysses_shard(impl: Impl) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory of the Ulysses GPT built from `impl`."""

    def shard(ref: nn.Module, ctx: RankContext) -> Sharded:
        return build_sharded(as_gpt(ref), ctx, impl)

    return shard


ULYSSES = register(Case(
    name="ulysses-gpt",
    description="DeepSpeed-Ulysses SP GPT: sequence-sharded activations, all-to-all seq<->heads around attention",
    **gpt_fields(DEFAULTS, positions=True),
    shard=ulysses_shard(CORRECT),
    validate=validate,
    tags=("ulysses",),
    examples=(
        Example(fields=(("world_size", 2),), note="even: 12 tokens 6/6, 4 heads 2/2, k/v heads 1/1"),
        Example(fields=(("world_size", 3), ("seq_len", 10)),
                note="uneven: 10 tokens 4/4/2, heads 2/1/1, 2 k/v heads over 3 ranks (k/v head 1 on two ranks)"),
        Example(fields=(("world_size", 3), ("seq_shards", (4, 0, 1))),
                note="a rank with no tokens and one with one token"),
        Example(fields=(("world_size", 4), ("num_heads", 6), ("hidden", 36), ("num_kv_heads", 6)),
                note="uneven heads 2/2/1/1, plain multi-head attention"),
        Example(fields=(("world_size", 4), ("num_kv_heads", 1)), note="MQA: one k/v head sent to all 4 ranks"),
        Example(fields=(("world_size", 3), ("num_heads", 2), ("hidden", 16), ("num_kv_heads", 1)),
                note="more ranks than heads: heads 1/1/0"),
        Example(fields=(("world_size", 2), ("causal", False), ("seq_len", 9)), note="non-causal, 9 tokens 5/4"),
        Example(fields=(("world_size", 4), ("dp", 2), ("seq_len", 7)), note="2 x 2 DP x SP mesh, 7 tokens 4/3"),
        Example(fields=(("world_size", 3), ("seq_len", 9), ("prompt_len", 6)),
                note="a 6-token prompt: ranks 0 and 1 hold no target tokens"),
    ),
))

__all__ = ["ULYSSES", "ulysses_shard", "CORRECT", "Impl", "validate"]
