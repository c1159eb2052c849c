"""DTensor (torch.distributed.tensor.parallel) plans as systems under test.

`seed-mlp` is the seed's exact plan on the seed's ToyModel; `dtensor-gpt` is a torchtitan-style
Megatron SP plan for reference/gpt.py. Parallel plans are plain dicts of submodule -> style.
Both split by torch.chunk (DTensor's Shard), so they run what the user would run; where PyTorch
breaks on uneven splits the harness reports FAIL with PyTorch's own error, and our tests pin it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from sp_harness.cases.common import (
    GPT_DEFAULTS,
    gpt_fields,
    known,
    mse_sum,
    require_chunk_split,
    require_heads,
    require_plain_attention,
)
from sp_harness.config.case import Case, Example, Layout, Sharded, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import register
from sp_harness.config.shards import chunk_sizes
from sp_harness.reference.toy_mlp import ToyModel

SEED_IN, SEED_OUT = 10, 5


def seed_plan() -> dict:
    return {
        "in_proj": ColwiseParallel(input_layouts=Shard(0)),
        "out_proj": RowwiseParallel(output_layouts=Shard(0)),
    }


def _seed_reference(config: CheckConfig) -> ToyModel:
    gen = torch.Generator().manual_seed(config.seed)
    model = ToyModel(SEED_IN, known(config.hidden, "hidden"), SEED_OUT).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5)
    return model


def _seed_batch(config: CheckConfig, step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # (S, in): the seed feeds a 2-D input whose dim 0 is the sharded sequence
    seq_len = known(config.seq_len, "seq_len")
    x = torch.rand(seq_len, SEED_IN, generator=gen, dtype=torch.float64)
    y = torch.randn(seq_len, SEED_OUT, generator=gen, dtype=torch.float64)
    return x, y


def _seed_validate(config: CheckConfig) -> None:
    if config.dp != 1:
        raise Unsupported(f"seed-mlp has no batch dim to split over data parallel ranks: dp({config.dp}) must be 1")
    if config.prompt_len:
        raise Unsupported(f"seed-mlp regresses float targets, it has no prompt: prompt_len({config.prompt_len}) must be 0")
    require_chunk_split(config, "seed-mlp")


def _seed_shard(model: nn.Module, ctx: RankContext) -> Sharded:
    module = parallelize_module(model, ctx.device_mesh, seed_plan())
    layout = Layout(seq_dim=0)
    return Sharded(module=module, input_layout=layout, output_layout=layout)


def _seed_expect(config: CheckConfig) -> str:
    # torch 2.13: every split even, or the upstream failure (docs/findings.md)
    tp, hidden = config.tp, known(config.hidden, "hidden")
    even = known(config.seq_len, "seq_len") % tp == 0 and hidden % tp == 0
    return "PASS" if even and hidden > 1 else "FAIL"


SEED_MLP = register(Case(
    name="seed-mlp",
    description="the seed's DTensor plan: ColwiseParallel(input_layouts=Shard(0)) + RowwiseParallel(output_layouts=Shard(0)) on ToyModel 10->32->5",
    build_reference=_seed_reference,
    make_batch=_seed_batch,
    loss_sum=mse_sum,
    tokens=lambda target: target.shape[0],
    shard=_seed_shard,
    validate=_seed_validate,
    defaults=dict(seq_len=12, hidden=32),
    input_layout=Layout(seq_dim=0),
    tags=("dtensor", "seed"),
    expect=_seed_expect,
    examples=(
        Example(fields=(("world_size", 2),), note="even: 12 tokens, 32 columns over 2"),
        Example(fields=(("world_size", 3),), note="upstream: 32 columns 11/11/10 fail sharding propagation"),
        Example(fields=(("world_size", 3), ("seq_len", 10), ("hidden", 33)),
                note="upstream: 10 tokens 4/4/2 abort gloo (from_local assumes even shards)"),
    ),
))


def gpt_plan(num_layers: int) -> dict:
    """torchtitan's Megatron-SP plan, adapted to reference/gpt.py's names.

    Embeddings run replicated on the full sequence; the first block's input is cut to sequence
    shards (Replicate -> Shard(1) is a local slice); norms run on shards (SequenceParallel);
    q/k/v and fc1 all-gather the sequence (Colwise with Shard(1) input); out-proj and fc2
    reduce-scatter back to sequence shards (Rowwise, output Shard(1)); the LM head gathers the
    sequence and returns replicated logits, as torchtitan does without loss parallelism.
    """
    plan: dict = {
        "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
        "norm_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(num_layers):
        b = f"blocks.{i}"
        plan.update({
            f"{b}.norm1": SequenceParallel(),
            f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{b}.attn.q_proj": ColwiseParallel(),
            f"{b}.attn.k_proj": ColwiseParallel(),
            f"{b}.attn.v_proj": ColwiseParallel(),
            f"{b}.attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{b}.norm2": SequenceParallel(),
            f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{b}.mlp.fc1": ColwiseParallel(),
            f"{b}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def _gpt_validate(config: CheckConfig) -> None:
    if config.dp != 1:
        raise Unsupported(f"dtensor-gpt runs on a 1-D tp mesh: dp({config.dp}) must be 1")
    require_chunk_split(config, "dtensor-gpt")
    require_plain_attention(config, "dtensor-gpt")
    require_heads(config)
    hidden = known(config.hidden, "hidden")
    head_dim = hidden // known(config.num_heads, "num_heads")
    cols = chunk_sizes(hidden, config.tp)
    if any(c % head_dim for c in cols):
        # Colwise splits q/k/v columns by torch.chunk, blind to head boundaries
        raise Unsupported(
            f"ColwiseParallel splits hidden({config.hidden}) over tp({config.tp}) as {list(cols)} columns, "
            f"not whole heads of head_dim({head_dim}); the reference's view(b, s, -1, head_dim) cannot run"
        )


def _gpt_shard(model: nn.Module, ctx: RankContext) -> Sharded:
    module = parallelize_module(model, ctx.device_mesh, gpt_plan(known(ctx.config.num_layers, "num_layers")))
    # modules the plan leaves alone (the embeddings) stay plain and whole on every rank
    return Sharded(module=module, input_layout=Layout(seq_dim=1, batch_dim=0, seq_sharded=False),
                   output_layout=Layout(seq_dim=1, batch_dim=0, seq_sharded=False), replicated=("*",))


def _gpt_expect(config: CheckConfig) -> str:
    # every split: the sequence, fc1/fc2's ffn, q/k/v and out-proj's hidden columns; and a vocab
    # of at least tp rows (2 rows over 3 ranks: AdamW's exp_avg.lerp_ fails sharding propagation
    # between an S(0) state and an R grad; 4 rows over 3, also 2/2/0, pass; found by the
    # false-alarm run, pinned as measured). A RowwiseParallel linear whose input width is 1 fails
    # even on one rank (sharding propagation on `aten.view` of a [1, 1] Shard(1) grad).
    tp, ffn, hidden = config.tp, known(config.ffn, "ffn"), known(config.hidden, "hidden")
    even = known(config.seq_len, "seq_len") % tp == 0 and ffn % tp == 0 and hidden % tp == 0 and known(config.vocab, "vocab") >= tp
    return "PASS" if even and ffn > 1 and hidden > 1 else "FAIL"


DTENSOR_GPT = register(Case(
    name="dtensor-gpt",
    description="torchtitan-style DTensor plan for the reference GPT (SequenceParallel norms, Colwise q/k/v/fc1, Rowwise out/fc2 -> Shard(1))",
    # the GPT's fields, but converge trains on its own make_batch stream (no Markov chain)
    **{**gpt_fields(GPT_DEFAULTS, positions=False), "training": None},
    shard=_gpt_shard,
    validate=_gpt_validate,
    tags=("dtensor",),
    expect=_gpt_expect,
    examples=(
        Example(fields=(("world_size", 2),), note="even"),
        Example(fields=(("world_size", 3),), note="Colwise cuts 32 columns 11/11/10, not whole heads"),
    ),
))
