"""Stage: step. The sharded run's parameters, assembled into full float64 reference tensors.

Each step's references start from the sharded run's own parameters (re-anchoring), so step k
is judged on its own: a rounding difference made at step k-1 is not carried into step k and
amplified there (AdamW divides by sqrt(v), which turns a grad's last-bit difference on a small
element into an lr-sized update). K steps stay as tight as one.

Every element of every reference parameter has exactly one owner rank: DP replica 0's piece for
TP-sharded params, its TP rank 0 for replicated ones, global rank 0 for DTensor params (whose
full tensor every rank can build). Owners write their piece into a zero buffer and one
all-reduce assembles it, exactly (x + 0 + ... + 0 == x). Replicas that differ are the replica
drift check's business; the anchor takes the owner's copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

from sp_harness.config import shards as sh
from sp_harness.config.case import ParamSpec
from sp_harness.config.rank_context import RankContext

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class LocalParam(Protocol):
    """What the anchor needs of one local parameter (sp_harness.step.params.LocalParam)."""

    param: torch.nn.Parameter
    dtensor: bool
    spec: ParamSpec


def gather_full(params: Sequence[LocalParam], shapes: dict[str, torch.Size],
                ctx: RankContext) -> dict[str, torch.Tensor]:
    """Full float64 tensors, by reference name, of the sharded run's current parameters.
    A collective over the world: every rank calls it with its params in the same order."""
    names = list(shapes)
    sizes = [shapes[n].numel() for n in names]
    total = sum(sizes)
    # values and ownership counts in one buffer: one collective
    buf = torch.zeros(2 * total, dtype=torch.float64, device=ctx.device)
    values, owners = buf[:total], buf[total:]
    value_of = {n: v.view(shapes[n]) for n, v in zip(names, values.split(sizes), strict=True)}
    owner_of = {n: o.view(shapes[n]) for n, o in zip(names, owners.split(sizes), strict=True)}
    for p in params:
        name = p.spec.ref_name
        local = p.param.detach()
        if p.dtensor:
            full = cast("DTensor", local).full_tensor()  # a collective for sharded placements: every rank calls it
            if ctx.rank == 0:
                value_of[name].copy_(full)
                owner_of[name].add_(1)
            continue
        if ctx.dp_rank != 0:
            continue
        spec = p.spec
        if spec.index is not None:
            target = spec.index(value_of[name])
            if target.numel() != local.numel():
                raise RuntimeError(f"ParamSpec.index of {name} gives {tuple(target.shape)} for the local param's "
                                   f"{tuple(local.shape)}: a view with the local param's number of elements")
            # a view of another shape (a strided split's blocks) holds the local elements in order
            target.copy_(local.reshape(target.shape))
            spec.index(owner_of[name]).add_(1)
        elif spec.dim is None:
            if ctx.tp_rank == 0:
                value_of[name].copy_(local)
                owner_of[name].add_(1)
        else:
            cut = spec.sizes or sh.chunk_sizes(shapes[name][spec.dim], ctx.tp)
            sh.shard(value_of[name], spec.dim, cut, ctx.tp_rank).copy_(local)
            sh.shard(owner_of[name], spec.dim, cut, ctx.tp_rank).add_(1)
    if dist.get_world_size() > 1:
        dist.all_reduce(buf)
    bad = [n for n in names if owner_of[n].numel() and not bool((owner_of[n] == 1).all())]
    if bad:
        raise RuntimeError(
            f"the sharded params do not cover each reference element exactly once: {bad} "
            "(a ParamSpec.index must return a view of the reference tensor, not a copy; sizes must sum to its dim)")
    return value_of
