"""Stage: step. Rank side: where a job runs: the device, the TP and DP groups, the rank context.

Groups and DTensor meshes are created once per pool: `new_group` is a collective every rank must
enter, and a pool serves many jobs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sp_harness.config import shards as sh
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext

_GROUPS: dict[tuple[int, int], Any] = {}
_MESHES: dict[tuple[int, int, str], Any] = {}


def rank_device() -> torch.device:
    """This rank's device: its GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _groups(world_size: int, dp: int):
    """TP and DP groups of a dp x tp mesh."""
    key = (world_size, dp)
    if key not in _GROUPS:
        tp = world_size // dp
        rank = dist.get_rank()
        mine = {}
        for d in range(dp):
            ranks = tuple(range(d * tp, (d + 1) * tp))
            g = dist.new_group(list(ranks)) if tp < world_size else dist.group.WORLD
            if rank in ranks:
                mine["tp"] = (g, ranks)
        for t in range(tp):
            ranks = tuple(range(t, world_size, tp))
            g = dist.new_group(list(ranks)) if dp < world_size else dist.group.WORLD
            if rank in ranks:
                mine["dp"] = (g, ranks)
        _GROUPS[key] = mine
    return _GROUPS[key]


def make_context(config: CheckConfig, device: torch.device) -> RankContext:
    world_size = dist.get_world_size()
    if world_size != config.world_size:
        raise RuntimeError(f"job for world_size {config.world_size} sent to a world of {world_size}")
    groups = _groups(world_size, config.dp)
    rank = dist.get_rank()
    tp = config.tp
    seq_shards = config.seq_shards or sh.chunk_sizes(config.seq_len or 0, tp)
    ctx = RankContext(config=config, rank=rank, world_size=world_size, dp_rank=rank // tp, tp_rank=rank % tp,
                      tp_group=groups["tp"][0], dp_group=groups["dp"][0], tp_ranks=groups["tp"][1],
                      dp_ranks=groups["dp"][1], seq_shards=tuple(seq_shards), device=device)
    tp_group, dp_group = groups["tp"][0], groups["dp"][0]
    world = dist.group.WORLD
    assert world is not None, "the default group exists (dist.get_world_size answered above)"
    ctx.groups.update(tp=tp_group, sp=tp_group, cp=tp_group, dp=dp_group, world=world)
    key = (world_size, config.dp, device.type)
    if key in _MESHES:
        ctx._mesh = _MESHES[key]
    else:
        _MESHES[key] = ctx.device_mesh
    return ctx


_SOLO: dict[int, Any] = {}


def _solo_group(world_size: int):
    """This rank's one-rank group: `new_group` is a collective, so every rank makes every one."""
    if world_size not in _SOLO:
        rank = dist.get_rank()
        for r in range(world_size):
            g = dist.new_group([r])
            if r == rank:
                _SOLO[world_size] = g
    return _SOLO[world_size]


def reference_context(config: CheckConfig, device: torch.device) -> RankContext:
    """The rank context a reference is built in: a single device, every group this rank alone
    (a one-rank world in the reference process, one-rank groups in a rank), the whole sequence.
    A framework's TP=1 reference makes its own one-rank state from it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = _solo_group(dist.get_world_size())
        me = (dist.get_rank(),)
    else:
        group, me = (dist.group.WORLD if dist.is_initialized() else None), (0,)
    ctx = RankContext(config=config, rank=0, world_size=1, dp_rank=0, tp_rank=0, tp_group=group, dp_group=group,
                      tp_ranks=me, dp_ranks=me, seq_shards=(config.seq_len or 0,), device=device)
    ctx.groups.update(tp=group, sp=group, cp=group, dp=group, world=group)
    return ctx
