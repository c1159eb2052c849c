"""A broken global grad-norm clip for the Megatron-style SP GPT.

Stage: config and step. Only training runs clip, so only the lockstep convergence entry of the
mutant battery can see it: the side-by-side checks step without clipping.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sp_harness.cases.megatron.cases import SP
from sp_harness.cases.megatron.impl import CORRECT
from sp_harness.cases.megatron.model import build_sharded
from sp_harness.config.case import Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant


def _shard_counting_replicas(ref, ctx: RankContext) -> Sharded:
    sharded = build_sharded(ref, ctx, CORRECT, sequence_parallel=True)
    params = list(sharded.module.parameters())

    def clip(max_norm: float) -> torch.Tensor:
        # every rank adds the squares of ALL its grads, replicated ones included, then sums over
        # TP: norms, biases, embeddings and the LM head are counted tp times
        sq = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=ctx.tp_group)
        norm = sq.sqrt()
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
        return norm

    sharded.clip_grad_norm = clip
    return sharded


CLIP_COUNTS_REPLICAS = mutant(
    SP, name="mutant-sp-clip-norm-counts-replicas",
    summary="global grad norm for clipping counts replicated params tp times",
    bug="grad norm for clipping counting replicated params TP times: each TP rank adds the squares of "
               "the replicated (norm, bias, embedding) grads before the TP all-reduce, inflating the norm and "
               "over-clipping (the NeMo-RL / Megatron get_grad_norm family: replicated params must be "
               "counted once, as Megatron's param_is_not_tensor_parallel_duplicate filter does)",
    source="Megatron-LM get_grad_norm_fp32 and param_is_not_tensor_parallel_duplicate; NeMo-RL grad-norm fixes",
    shard=_shard_counting_replicas,
    killed_by=("lockstep gate", "lockstep"),
)
