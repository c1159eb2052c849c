"""Stage: capture. The attention work each context-parallel rank really does in a forward.

A module that scores attention block by block may keep a `work: list[int]` attribute, to which
each forward appends the unmasked (query, key) score elements of every block it computed (per
sequence and head; cases/ring/attention.py's RingAttention does). A load balancer is judged on
these counts, taken on the ranks in a real forward of the case's sharded model (the load-balance
check's rank job, sp_harness.checks.balance_rank), not on where the case says it put its
tokens: a case whose masks, block skipping or placement disagree with its declaration is
measured as it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True)
class RankWork:
    """What one rank's attention scored in one forward."""

    rank: int
    cp_rank: int
    """Its rank in the context-parallel (SP) group."""
    dp_rank: int
    num_meters: int
    """Modules that reported work (attention layers); 0: the case exposes none."""
    num_blocks: int
    """Blocks scored, over all layers (a fully masked block is skipped and not counted)."""
    score_elements: int
    """Unmasked (query, key) pairs scored, over all layers, per sequence and head."""


def work_meters(model: torch.nn.Module) -> list[list[int]]:
    """The `work` lists of the modules that keep one (see the module docstring)."""
    found = [getattr(m, "work", None) for m in model.modules()]
    return [work for work in found if isinstance(work, list)]
