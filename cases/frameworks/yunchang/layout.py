"""Stage: step. Where yunchang puts each token and each rank: the Ulysses x ring degrees of a
run, the placement of yunchang's own `EXTRACT_FUNC_DICT[impl]` mirrored as a `Layout.seq_order`
(zigzag: 2 x ring_degree chunks, ring rank r holding chunks r and 2R-1-r, cut among its Ulysses
group; strip; basic: contiguous), and yunchang's process groups (`set_seq_parallel_pg`) made and
installed for a job. The case's shard checks each rank's tokens against yunchang's extract
function, so a placement here that drifted from yunchang's would stop every run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sp_harness.config.check_config import CheckConfig


def default_ring_degree(sp: int) -> int:
    """2 where it divides sp (world 2: a pure ring; 4: 2 x 2), else 1 (pure Ulysses)."""
    return 2 if sp % 2 == 0 else 1


def degrees(config: CheckConfig) -> tuple[int, int]:
    """(ulysses_degree, ring_degree) of a resolved config."""
    ring = config.ring_degree or default_ring_degree(config.tp)
    return config.tp // ring, ring


# --- where yunchang puts each token -------------------------------------------------------------

def grid_coords(t: int, ulysses: int, ring: int, use_ulysses_low: bool) -> tuple[int, int]:
    """SP rank t -> (ring rank r, Ulysses rank u) in yunchang's `set_seq_parallel_pg` layout:
    ulysses-low: Ulysses groups are runs of `ulysses` consecutive ranks; else the ring groups are."""
    return divmod(t, ulysses) if use_ulysses_low else (t % ring, t // ring)


def extract_positions(impl: str, seq_len: int, ulysses: int, ring: int, use_ulysses_low: bool) -> list[torch.Tensor]:
    """Per SP rank, the global positions yunchang's `EXTRACT_FUNC_DICT[impl]` gives it (what
    `*_extract_local(value, rank, world_size, rd, ud)` keeps of value = arange(seq_len))."""
    sp = ulysses * ring
    pos = torch.arange(seq_len)
    if impl == "zigzag":  # zigzag_extract_local: ring rank r's chunks r and 2R-1-r, cut among its Ulysses group
        chunks = pos.chunk(2 * ring)
        out = []
        for t in range(sp):
            r, u = grid_coords(t, ulysses, ring, use_ulysses_low)
            out.append(torch.cat([chunks[r], chunks[2 * ring - 1 - r]]).chunk(ulysses)[u])
        return out
    if impl == "strip":  # stripe_extract_local: stripes of the ring degree, then chunked by SP rank
        striped = pos.reshape(seq_len // ring, ring).t().reshape(-1)
        return list(striped.chunk(sp))
    return list(pos.chunk(sp))  # basic_extract_local: contiguous by SP rank


def seq_order(impl: str, ulysses: int, ring: int, use_ulysses_low: bool) -> Callable[[int, tuple[int, ...]], torch.Tensor]:
    """`Layout.seq_order` for yunchang's placement `impl`."""

    def order(seq_len: int, seq_shards: tuple[int, ...]) -> torch.Tensor:
        return torch.cat(extract_positions(impl, seq_len, ulysses, ring, use_ulysses_low))

    return order


# --- yunchang's process groups -----------------------------------------------------------------

_PGS: dict[tuple, tuple[Any, Any]] = {}


def yunchang_groups(ctx, ulysses: int, ring: int, use_ulysses_low: bool,
                    set_pg: Callable | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """yunchang's own `set_seq_parallel_pg` for this world and these degrees (a collective every
    rank runs alike: once per process and key), its groups installed in yunchang's global
    `PROCESS_GROUP` for this job; returns (Ulysses ranks, ring ranks) of this rank, checked to lie
    in the harness's SP group. `set_pg`: a replacement for `set_seq_parallel_pg` (a mutant's,
    whose groups are not checked: they are its bug)."""
    from yunchang.globals import PROCESS_GROUP, set_seq_parallel_pg

    key = (ctx.world_size, ulysses, ring, use_ulysses_low, set_pg)
    if key not in _PGS:
        (set_pg or set_seq_parallel_pg)(ulysses, ring, ctx.rank, ctx.world_size, use_ulysses_low=use_ulysses_low)
        _PGS[key] = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = _PGS[key]
    uly = tuple(dist.get_process_group_ranks(PROCESS_GROUP.ULYSSES_PG))
    rng = tuple(dist.get_process_group_ranks(PROCESS_GROUP.RING_PG))
    if set_pg is None and not set(uly) | set(rng) <= set(ctx.tp_ranks):
        raise RuntimeError(f"yunchang's groups (ulysses {uly}, ring {rng}) leave the SP group {ctx.tp_ranks}")
    ctx._group_names.setdefault(uly, "ulysses")  # names for the collective accounting
    ctx._group_names.setdefault(rng, "ring")
    return uly, rng


__all__ = ["default_ring_degree", "degrees", "extract_positions", "grid_coords", "seq_order", "yunchang_groups"]
