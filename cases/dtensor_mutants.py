"""Broken DTensor plans: slips in `parallelize_module` plans that run without an error.

Stage: config and step. Each is the correct plan (cases/dtensor_plans.py) with one entry changed.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from sp_harness.cases.common import known
from sp_harness.cases.dtensor_plans import DTENSOR_GPT, SEED_MLP, gpt_plan
from sp_harness.config.case import Layout, Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant


def _gpt_shard(plan_edit=None, before=None):
    def shard(model, ctx: RankContext) -> Sharded:
        if before is not None:
            before(model, ctx)
        plan = gpt_plan(known(ctx.config.num_layers, "num_layers"))
        if plan_edit is not None:
            plan_edit(plan)
        module = parallelize_module(model, ctx.device_mesh, plan)
        io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)
        # modules the plan leaves alone stay plain and whole on every rank: replicated copies
        return Sharded(module=module, input_layout=io, output_layout=io, replicated=("*",))

    return shard


def _drop_norm2_sp(plan: dict) -> None:
    del plan["blocks.0.norm2"]


def _init_norms_per_rank(model, ctx: RankContext) -> None:
    # each rank "initialises" its own norm weights (a per-rank seed), as a model built before
    # the plan on ranks with different RNG states would
    gen = torch.Generator().manual_seed(1000 + ctx.rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1e-3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))


NORM_MISSING_SP = mutant(
    DTENSOR_GPT, name="mutant-dtensor-norm-missing-sp", tags=("dtensor",),
    summary="blocks.0.norm2 left out of the plan",
    bug="a norm missing SequenceParallel in the plan: it runs as a plain module on the local sequence "
               "shard, so its weight grads are partial sums never reduced over TP (the DTensor form of "
               "GPT-NeoX #1257; torchtitan's plans list every norm for this reason)",
    source="GPT-NeoX PR #1257 (the DTensor form); torchtitan's parallelize plans list every norm",
    shard=_gpt_shard(plan_edit=_drop_norm2_sp),
    killed_by=("grad", "even"),
)

NORM_INIT_PER_RANK = mutant(
    DTENSOR_GPT, name="mutant-dtensor-norm-init-per-rank", tags=("dtensor",),
    summary="norm weights differ per rank before parallelize_module",
    bug="norm weights initialised differently per rank: SequenceParallel wraps them with "
               "DTensor.from_local(..., Replicate(), run_check=False) and never broadcasts, so replicas "
               "silently start (and stay) different (PyTorch's SequenceParallel docstring: the weights "
               "are assumed to be initialised identically)",
    source="PyTorch SequenceParallel docstring (torch/distributed/tensor/parallel/style.py): norm weights must be initialised identically on every rank",
    shard=_gpt_shard(before=_init_norms_per_rank),
    killed_by=("init", "even"),
)


def _seed_wrong_output_dim(model, ctx: RankContext) -> Sharded:
    plan = {"in_proj": ColwiseParallel(input_layouts=Shard(0)),
            "out_proj": RowwiseParallel(output_layouts=Shard(1))}
    module = parallelize_module(model, ctx.device_mesh, plan)
    return Sharded(module=module, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0))


SEED_WRONG_DIM = mutant(
    SEED_MLP, name="mutant-dtensor-output-wrong-dim", tags=("dtensor",),
    summary="RowwiseParallel(output_layouts=Shard(1))",
    bug="output sharded on the wrong dim: the reduce-scatter splits features instead of the "
               "sequence (Shard(1) for Shard(0)), so every rank holds a feature slice of all tokens; "
               "shapes still line up for a loss that sums everything",
    source="the wrong-dim collective class of GPT-NeoX PR #1260, as a RowwiseParallel output_layouts",
    shard=_seed_wrong_output_dim,
    killed_by=("crash", "even"),
)
