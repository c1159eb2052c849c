"""The 2-D factorisation of the SP group: sp = ulysses_degree x ring_degree.

Stage: step. SP rank t (the engine's TP rank) is (r, u) = divmod(t, U): Ulysses groups
are runs of U consecutive SP ranks ("ulysses-low", yunchang's default), ring groups take one rank
from each run (stride U). With contiguous shards a Ulysses group's combined tokens are then one
contiguous chunk, and ring rank r holds chunk r.

`dist.new_group` is a collective over the whole world: every rank creates every group of every
DP replica, in the same order, once per process (a pool serves many jobs; the engine caches its
TP/DP groups the same way in step/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sp_harness.config.rank_context import RankContext


@dataclass(kw_only=True, frozen=True)
class Grid:
    """This rank's place in the U x R grid of its SP group, and the groups it belongs to."""

    ulysses_degree: int
    ring_degree: int
    u: int
    """Index in the Ulysses group (which heads this rank attends)."""
    r: int
    """Index in the ring (which Ulysses group's tokens it holds)."""
    ulysses_ranks: tuple[int, ...]
    """Global ranks of my Ulysses group, in all-to-all order."""
    ring_ranks: tuple[int, ...]
    """Global ranks of my ring, in ring order."""
    ulysses_group: Any
    ring_group: Any

    def members(self, r: int) -> range:
        """SP ranks of ring rank r's Ulysses group."""
        return range(r * self.ulysses_degree, (r + 1) * self.ulysses_degree)

    def group_shards(self, seq_shards: tuple[int, ...]) -> tuple[int, ...]:
        """Tokens of each ring rank's Ulysses group (the ring's k/v block lengths)."""
        return tuple(sum(seq_shards[t] for t in self.members(r)) for r in range(self.ring_degree))


_GROUPS: dict[tuple[int, int, int], dict[str, tuple[tuple[int, ...], Any]]] = {}


def _make_groups(world_size: int, dp: int, ulysses: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Every Ulysses group, then every ring group, of every DP replica: same order on all ranks."""
    key = (world_size, dp, ulysses)
    if key not in _GROUPS:
        sp, me = world_size // dp, dist.get_rank()
        ring = sp // ulysses
        blocks = {
            "ulysses": [tuple(d * sp + r * ulysses + u for u in range(ulysses)) for d in range(dp) for r in range(ring)],
            "ring": [tuple(d * sp + r * ulysses + u for r in range(ring)) for d in range(dp) for u in range(ulysses)],
        }
        mine = {}
        for name, partition in blocks.items():
            for ranks in partition:  # every rank creates every group, in the same order
                g = dist.new_group(list(ranks))
                if me in ranks:
                    mine[name] = (ranks, g)
        _GROUPS[key] = mine
    return _GROUPS[key]


def make_grid(ctx: RankContext, ring_degree: int) -> Grid:
    """This rank's grid (groups None where the context has no process group)."""
    sp, ulysses = ctx.tp, ctx.tp // ring_degree
    assert ulysses * ring_degree == sp, (sp, ring_degree)
    r, u = divmod(ctx.tp_rank, ulysses)
    if ctx.tp_group is None:  # no process group (a driver-side look at the placement): no groups
        base = ctx.tp_ranks[0]
        uly = (tuple(base + r * ulysses + i for i in range(ulysses)), None)
        rng = (tuple(base + i * ulysses + u for i in range(ring_degree)), None)
    else:
        groups = _make_groups(ctx.world_size, ctx.dp, ulysses)
        uly, rng = groups["ulysses"], groups["ring"]
    return Grid(ulysses_degree=ulysses, ring_degree=ring_degree, u=u, r=r, ulysses_ranks=uly[0],
                ring_ranks=rng[0], ulysses_group=uly[1], ring_group=rng[1])


def group_positions(grid: Grid, positions: tuple, seq_shards: tuple[int, ...]) -> tuple:
    """Per ring rank, the global positions of its Ulysses group's tokens in the order the
    seq->heads all-to-all concatenates them (member by member): what the causal mask needs."""
    assert len(positions) == len(seq_shards) == grid.ulysses_degree * grid.ring_degree
    return tuple(torch.cat([positions[t] for t in grid.members(r)]) for r in range(grid.ring_degree))


__all__ = ["Grid", "make_grid", "group_positions"]
