"""Broken variants of usp-gpt: each is the correct `Impl` with one piece swapped.

Stage: build sharded. The default battery runs world sizes 2 (sp 2: U = 1, R = 2), 3 (sp 3:
U = 3, R = 1) and a 2 x 2 DP x SP mesh (sp 2), so it never sees U and R both > 1; these two
bugs show at its pure-Ulysses (sp 3) entry. Which configs expose each one is next to it.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from sp_harness.cases.ring.placement import ORDERS
from sp_harness.cases.ulysses.model import all_reduce_coalesced
from sp_harness.cases.usp.cases import USP, usp_shard
from sp_harness.cases.usp.groups import Grid
from sp_harness.cases.usp.model import CORRECT
from sp_harness.cases.usp.placement import usp_order
from sp_harness.config.case import RankContext, mutant

TAGS = ("usp",)


def usp_mutant(name: str, summary: str, bug: str, *, source: str, **swap):
    """`CORRECT` with the `Impl` fields in `swap` replaced, registered as a mutant of usp-gpt."""
    return mutant(USP, name=name, summary=summary, bug=bug, source=source, tags=TAGS,
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
)


# (b) any U > 1 (the battery's uneven entry, sp 3 = 3 x 1): the Ulysses ranks' partial grads
# are never added.
def _sync_over_ring_only(module: nn.Module, ctx: RankContext, grid: Grid) -> None:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if grid.ring_degree > 1:
        all_reduce_coalesced(grads, grid.ring_group)  # wrong: the Ulysses ranks' shares are missing
    if ctx.dp > 1:
        all_reduce_coalesced(grads, ctx.dp_group, divide_by=ctx.dp)


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
)
