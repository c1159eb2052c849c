"""The Megatron-style GPT cases: megatron-gpt-ref, megatron-gpt-tp, megatron-gpt-sp.

Stage: config and step. `megatron_case(name, mode, impl, ...)` makes a Case
from an `Impl`; mutants use it with one piece of `CORRECT` swapped.

Supported: any dp x tp mesh with tp <= num_heads; uneven heads, ffn and sequence shards
(torch.chunk's split or explicit seq_shards), including ranks with no sequence tokens, no heads
(4 heads over tp=3 are 2/2/0) or no ffn columns; both layouts ("bsh", "sbh"); both norms.
Unsupported: tp > num_heads (tp - num_heads ranks would hold no heads); megatron-gpt-ref with
tp > 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from sp_harness.cases.common import (
    GPT_DEFAULTS,
    IGNORE_INDEX,
    gpt_fields,
    known,
    require_heads,
    require_plain_attention,
    sum_replicated_grads,
    with_defaults,
)
from sp_harness.cases.megatron.impl import CORRECT, Impl
from sp_harness.cases.megatron.model import build_sharded
from sp_harness.cases.train_steps import marked_sequence_parallel, with_train_step
from sp_harness.config.case import Case, Example, Layout, Sharded, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import register
from sp_harness.config.step_protocol import TrainLoss

DEFAULTS = dict(GPT_DEFAULTS)
FIELDS = gpt_fields(DEFAULTS, positions=False)
"""The Case fields the three share: the GPT takes its tokens only (it embeds positions itself)."""


def _validate_model(config: CheckConfig) -> CheckConfig:
    config = with_defaults(config, DEFAULTS)
    require_plain_attention(config, "the Megatron-style GPT")
    require_heads(config)
    return config


def validate_parallel(config: CheckConfig) -> None:
    config = _validate_model(config)
    heads = known(config.num_heads, "num_heads")
    if config.tp > heads:
        raise Unsupported(f"tp({config.tp}) > num_heads({heads}): {config.tp - heads} rank(s) would hold no heads")


def validate_single(config: CheckConfig) -> None:
    config = _validate_model(config)
    if config.tp != 1:
        raise Unsupported(
            f"the reference mode runs unsharded: needs tp == 1, got world_size({config.world_size})"
            f" / dp({config.dp}) = tp({config.tp})"
        )


def _shard_single(ref: nn.Module, ctx: RankContext) -> Sharded:
    """The reference itself on each DP replica; grads averaged over DP."""

    io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)
    return Sharded(module=ref, input_layout=io, output_layout=io, replicated=("*",),
                   sync_grads=lambda: sum_replicated_grads(ref, ctx, over=()))


def megatron_shard(impl: Impl, *, sequence_parallel: bool) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory of the Megatron GPT built from `impl`."""
    return lambda ref, ctx: build_sharded(ref, ctx, impl, sequence_parallel=sequence_parallel)


def megatron_case(
    name: str,
    mode: str,
    impl: Impl = CORRECT,
    *,
    description: str,
    tags: tuple[str, ...] = ("megatron",),
    models_bug: str = "",
    twin: str = "",
) -> Case:
    """A Case for the Megatron GPT in `mode` "tp" (tensor parallel) or "sp" (TP + sequence
    parallel) built from `impl`; not registered (call `register`)."""
    if mode not in ("tp", "sp"):
        raise ValueError(f"mode must be 'tp' or 'sp', got {mode!r}")
    sp = mode == "sp"
    return Case(
        name=name,
        description=description,
        **FIELDS,
        shard=megatron_shard(impl, sequence_parallel=sp),
        validate=validate_parallel,
        tags=tags,
        models_bug=models_bug,
        twin=twin,
        # an SP implementation must match its TP twin's communication volume and training curve
        baseline="megatron-gpt-tp" if sp else "",
    )


REF = register(
    Case(
        name="megatron-gpt-ref",
        description="nanoGPT reference on one device per DP replica (tp must be 1)",
        **FIELDS,
        shard=_shard_single,
        validate=validate_single,
        tags=("megatron", "reference"),
        examples=(Example(fields=(("world_size", 2), ("dp", 2)), note="reference mode on 2 DP replicas"),),
    )
)
TP = register(dataclasses.replace(
    megatron_case(
        "megatron-gpt-tp",
        "tp",
        description="Megatron-style tensor parallel GPT (heads/ffn split, no SP)",
    ),
    examples=(
        Example(fields=(("world_size", 2),), note="even"),
        Example(fields=(("world_size", 3), ("seq_len", 10), ("num_heads", 4), ("ffn", 50)),
                note="uneven heads 2/1/1 and ffn 17/17/16"),
    ),
))
SP = register(dataclasses.replace(
    megatron_case(
        "megatron-gpt-sp",
        "sp",
        description="Megatron-style TP + sequence parallel GPT (all-gather/reduce-scatter)",
    ),
    # its own training step: per-token loss over the global valid tokens, as Megatron's schedule
    shard=with_train_step(megatron_shard(CORRECT, sequence_parallel=True), marked_sequence_parallel),
    train_loss=TrainLoss(ignore_index=IGNORE_INDEX),
    examples=(
        Example(fields=(("world_size", 2),), note="even"),
        Example(fields=(("world_size", 3), ("seq_len", 10)), note="uneven: 10 tokens 4/4/2, heads 2/2/0"),
        Example(fields=(("world_size", 3), ("seq_len", 10), ("layout", "sbh"), ("norm", "rmsnorm")),
                note="uneven, [s, b, h], RMSNorm"),
        Example(fields=(("world_size", 4), ("dp", 2)), note="2 x 2 DP x TP mesh"),
        Example(fields=(("world_size", 4), ("dp", 2), ("seq_len", 7), ("dtype", "float32")),
                note="2 x 2 mesh, 7 tokens 4/3, float32"),
        Example(fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 3), ("optimizer", "sgd"),
                        ("clip_grad_norm", 0.01)),
                note="its own training step: 3 uneven micro-batches (the last empty, one rank without tokens), "
                     "SGD, clipping active"),
    ),
))

__all__ = ["megatron_case", "megatron_shard", "REF", "TP", "SP", "CORRECT", "Impl"]
