"""Broken variants of usp-gpt: each is the correct `Impl` with one piece swapped.

Stage: config and step. The default battery runs world sizes 2 (sp 2: U = 1, R = 2), 3 (sp 3:
U = 3, R = 1), a 2 x 2 DP x SP mesh (sp 2), and, in its '2x2' entry, sp 4 = 2 x 2, the only one
with U and R both > 1. Which configs expose each one is next to it.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from sp_harness.cases.common import as_gpt, sum_replicated_grads
from sp_harness.cases.ring.placement import ORDERS
from sp_harness.cases.usp.cases import USP, default_ring_degree, usp_shard
from sp_harness.cases.usp.groups import Grid, make_grid
from sp_harness.cases.usp.model import CORRECT, build_sharded
from sp_harness.cases.usp.placement import usp_order
from sp_harness.config.case import Sharded, Unsupported
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant

TAGS = ("usp",)


def usp_mutant(name: str, summary: str, bug: str, *, source: str, killed_by: tuple[str, ...] = (), **swap):
    """`CORRECT` with the `Impl` fields in `swap` replaced, registered as a mutant of usp-gpt."""
    return mutant(USP, name=name, summary=summary, bug=bug, source=source, killed_by=killed_by, tags=TAGS,
                  shard=usp_shard(dataclasses.replace(CORRECT, **swap)))


# (a) zigzag with U > 1 (the battery's uneven entry: sp 3 = 3 x 1, where the ring-level zigzag is
# the contiguous split): tokens zigzagged over all sp ranks, masks for the ring-level zigzag.
ZIGZAG_OVER_SP = usp_mutant(
    "mutant-usp-zigzag-over-sp",
    "tokens zigzag-placed over all sp ranks while the ring's masks assume zigzag over the ring",
    "load-balanced sharding of a hybrid Ulysses x ring run done with the context-parallel recipe over the "
    "whole SP group (2 x sp chunks, SP rank t holds chunks t and 2sp-1-t) while the hybrid attention "
    "balances, and builds its causal masks, over the ring dimension only (2 x ring_degree chunks, each "
    "split among the Ulysses ranks): every query is masked as if it sat elsewhere. The bug class of "
    "reusing a CP data loader's split for USP (yunchang's tests shard zigzag inputs with both "
    "ring_degree and ulysses_degree for this reason)",
    source="bug class: a CP-world zigzag split fed to USP (yunchang test_hybrid_attn.py extract_local(rd, ud))",
    placement=lambda balancer, ring_degree: ORDERS[balancer],
    mask_placement=usp_order,
    killed_by=("forward", "uneven"),
)


# (b) any U > 1 (the battery's uneven entry, sp 3 = 3 x 1): the Ulysses ranks' partial grads
# are never added.
def _sync_over_ring_only(module: nn.Module, ctx: RankContext, grid: Grid) -> None:
    sum_replicated_grads(module, ctx, over=(grid.ring_group,))  # wrong: the Ulysses ranks' shares are missing


GRAD_SYNC_RING_ONLY = usp_mutant(
    "mutant-usp-grad-sync-ring-only",
    "replicated grads summed over the ring (context-parallel) group only",
    "replicated grads all-reduced over the ring group a context-parallel trainer already had, not the "
    "whole Ulysses x ring SP group: each Ulysses rank's grads keep only its own tokens' share (and its "
    "own heads' share of the attention projections), and replicas drift. The reduce-over-the-wrong-"
    "sub-group class of hybrid meshes (DeepSpeed-Ulysses reduces over the sequence-data-parallel "
    "group, arXiv:2309.14509; GPT-NeoX PR #1259 summed SP grads over the wrong group)",
    source="bug class: grad all-reduce over a sub-group of SP (arXiv:2309.14509 section 3; GPT-NeoX PR #1259)",
    sync_grads=_sync_over_ring_only,
    killed_by=("grad", "uneven"),
)


# (c) U and R both > 1 (the battery's '2x2' entry): where one of them is 1 the two rank layouts of
# the grid coincide and this is the correct case.
def _ring_low_groups(ref: nn.Module, ctx: RankContext) -> Sharded:
    """Process groups laid out ring-low (Ulysses groups strided, rings consecutive) while the
    tokens, split sizes and mask positions are laid out ulysses-low. At U = R the strided
    Ulysses groups are exactly the correct ring groups, so swapping the two models it exactly."""
    grid = make_grid(ctx, ctx.config.ring_degree or default_ring_degree(ctx.tp))
    if grid.ulysses_degree == 1 or grid.ring_degree == 1:
        return build_sharded(as_gpt(ref), ctx, grid, CORRECT)
    if grid.ulysses_degree != grid.ring_degree:
        raise Unsupported(f"the ring-low mutant is modelled at U = R only: U({grid.ulysses_degree}) != "
                          f"R({grid.ring_degree})")
    # each rank's index in the strided group is its ring index, and vice versa
    swapped = dataclasses.replace(grid, u=grid.r, r=grid.u, ulysses_ranks=grid.ring_ranks,
                                  ring_ranks=grid.ulysses_ranks, ulysses_group=grid.ring_group,
                                  ring_group=grid.ulysses_group)
    return build_sharded(as_gpt(ref), ctx, swapped, CORRECT)


RING_LOW_GROUPS = mutant(
    USP, name="mutant-usp-ring-low-groups", summary="ring-low process groups, ulysses-low tokens",
    bug="Ulysses and ring process groups laid out the other way round from the token placement: the "
        "all-to-all runs over strided ranks whose tokens are not the group's combined chunk, and the "
        "ring passes blocks between ranks of one chunk (yunchang set_seq_parallel_pg's use_ulysses_low "
        "disagreeing with how the inputs were split)",
    source="bug class: yunchang set_seq_parallel_pg(use_ulysses_low) vs the input split",
    tags=TAGS, shard=_ring_low_groups, killed_by=("forward", "2x2"))
