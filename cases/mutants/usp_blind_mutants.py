"""A usp-gpt bug the default battery cannot see, so NOT registered (loaded by path in
tests/test_usp.py: `cases/mutants/usp_blind_mutants.py:RING_LOW_GROUPS`).

The battery's SP sizes are 2 and 3, where one of U and R is 1 and the two rank layouts of the
grid coincide. This one needs U and R both > 1 (world_size 4 = 2 x 2).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from sp_harness.cases.usp.cases import USP, default_ring_degree
from sp_harness.cases.usp.groups import make_grid
from sp_harness.cases.usp.model import CORRECT, build_sharded
from sp_harness.config.case import RankContext, Sharded


def _ring_low_groups(ref: nn.Module, ctx: RankContext) -> Sharded:
    """Process groups laid out ring-low (Ulysses groups strided, rings consecutive) while the
    tokens, split sizes and mask positions are laid out ulysses-low. At U = R the strided
    Ulysses groups are exactly the correct ring groups, so swapping the two models it exactly."""
    grid = make_grid(ctx, ctx.config.ring_degree or default_ring_degree(ctx.tp))
    assert grid.ulysses_degree == grid.ring_degree, "modelled exactly only at U = R"
    # each rank's index in the strided group is its ring index, and vice versa
    swapped = dataclasses.replace(grid, u=grid.r, r=grid.u, ulysses_ranks=grid.ring_ranks,
                                  ring_ranks=grid.ulysses_ranks, ulysses_group=grid.ring_group,
                                  ring_group=grid.ulysses_group)
    return build_sharded(ref, ctx, swapped, CORRECT)


RING_LOW_GROUPS = dataclasses.replace(
    USP, name="mutant-usp-ring-low-groups", description="MUTANT usp-gpt: ring-low process groups, ulysses-low tokens",
    models_bug="Ulysses and ring process groups laid out the other way round from the token placement: the "
               "all-to-all runs over strided ranks whose tokens are not the group's combined chunk, and the "
               "ring passes blocks between ranks of one chunk (yunchang set_seq_parallel_pg's use_ulysses_low "
               "disagreeing with how the inputs were split)",
    source="bug class: yunchang set_seq_parallel_pg(use_ulysses_low) vs the input split",
    twin=USP.name, tags=USP.tags + ("mutant", "battery-blind"), examples=(), shard=_ring_low_groups)
