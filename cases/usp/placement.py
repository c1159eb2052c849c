"""Where each USP rank's tokens sit. Pure functions, no process group.

The ring balances over its R ranks, not over all sp = U x R ranks: a Ulysses group's members
attend the SAME query and key tokens (each on its own heads), so what must be balanced is the
combined token set of each Ulysses group. The zigzag of cases/ring/placement.py is applied to
the R group-sized shards (ring rank r's group holds an early and a late run), and that group's
tokens are then cut contiguously, in this order, among its U members. For U = 1 this is exactly
ring-gpt's zigzag; for R = 1 it is the contiguous split (one ring rank holds everything).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sp_harness.cases.ring.placement import ORDERS, contiguous_order


def group_sizes(seq_shards: tuple[int, ...], ring_degree: int) -> tuple[int, ...]:
    """Tokens of each ring rank's Ulysses group: runs of U = len(seq_shards) / R SP shards."""
    ulysses = len(seq_shards) // ring_degree
    assert ulysses * ring_degree == len(seq_shards), (seq_shards, ring_degree)
    return tuple(sum(seq_shards[r * ulysses:(r + 1) * ulysses]) for r in range(ring_degree))


def usp_order(load_balancer: str, ring_degree: int) -> Callable[[int, tuple[int, ...]], torch.Tensor]:
    """load_balancer -> Layout.seq_order over SP shards: the ring-level placement of the groups."""
    if load_balancer == "none":
        return contiguous_order
    ring_order = ORDERS[load_balancer]

    def order(seq_len: int, seq_shards: tuple[int, ...]) -> torch.Tensor:
        return ring_order(seq_len, group_sizes(seq_shards, ring_degree))

    return order
