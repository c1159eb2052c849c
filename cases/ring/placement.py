"""Where each context-parallel rank's tokens sit in the sequence, and how much attention work
that placement gives each rank. Pure functions, no process group.

Zigzag (load-balanced causal attention, as in Megatron-LM / TransformerEngine / PyTorch CP): cut
the sequence into 2W chunks and give rank i chunks i and 2W-1-i, so each rank holds one early
and one late chunk and every rank scores about the same number of causal (query, key) pairs.
Generalised here to any shard sizes: rank i's `seq_shards[i]` tokens are a front half of
ceil(n_i / 2) tokens and a back half of the rest; front halves are laid out from the start of
the sequence in rank order, back halves after them in reverse rank order. For seq_len divisible
by 2W with even shards that is exactly the 2W-chunk zigzag; for any other length nothing is
padded and nothing is dropped (the halves just differ by one token).
"""

from __future__ import annotations

import torch

from sp_harness.config import shards as sh


def contiguous_order(seq_len: int, seq_shards: tuple[int, ...]) -> torch.Tensor:
    """The identity placement: rank r holds one contiguous run of positions."""
    return torch.arange(seq_len)


def zigzag_order(seq_len: int, seq_shards: tuple[int, ...]) -> torch.Tensor:
    """Positions in rank order under zigzag placement (see the module docstring)."""
    if sum(seq_shards) != seq_len:
        raise ValueError(f"seq_shards {list(seq_shards)} sum to {sum(seq_shards)}, not seq_len({seq_len})")
    fronts = [-(-n // 2) for n in seq_shards]
    backs = [n - f for n, f in zip(seq_shards, fronts, strict=True)]
    front_start = sh.offsets(fronts)
    # back halves: rank W-1's first, right after the last front half, rank 0's at the very end
    back_start, at = [0] * len(seq_shards), sum(fronts)
    for r in reversed(range(len(seq_shards))):
        back_start[r], at = at, at + backs[r]
    pieces = []
    for r in range(len(seq_shards)):
        pieces += [torch.arange(front_start[r], front_start[r] + fronts[r]),
                   torch.arange(back_start[r], back_start[r] + backs[r])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


ORDERS = {"none": contiguous_order, "zigzag": zigzag_order}
"""load_balancer -> placement."""


def rank_positions(order: torch.Tensor, seq_shards: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Each rank's global positions, in its local order, from a placement."""
    return tuple(order.narrow(0, off, n) for off, n in zip(sh.offsets(seq_shards), seq_shards, strict=True))


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor:
    """(s_q, s_k) bool: which (query, key) pairs of two blocks attend, from their GLOBAL positions."""
    if causal:
        return k_pos[None, :] <= q_pos[:, None]
    return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)


def attention_work(seq_len: int, seq_shards: tuple[int, ...], load_balancer: str, causal: bool) -> list[int]:
    """Per rank, the unmasked (query, key) pairs of the blocks it computes in one ring pass (per
    sequence and head): the score elements a block-skipping ring attention really works on."""
    positions = rank_positions(ORDERS[load_balancer](seq_len, seq_shards), seq_shards)
    return work_of(positions, causal)


def work_of(positions: tuple[torch.Tensor, ...], causal: bool) -> list[int]:
    """`attention_work` for explicit per-rank positions (any placement)."""
    return [sum(int(block_mask(q, k, causal).sum()) for k in positions) for q in positions]


def imbalance(work: list[int]) -> float:
    """max / min work over the ranks that hold tokens (inf if one of them does none)."""
    busy = [w for w in work if w > 0] or [0]
    return max(busy) / min(busy) if min(busy) > 0 else float("inf")
