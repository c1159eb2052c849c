"""Stage: compare. Communication volume of an SP implementation against its TP twin's.

`ring_bytes` is what one rank sends on a ring: 2(t-1)/t of the payload for an all-reduce and
(t-1)/t for an all-gather or reduce-scatter, the accounting of Korthikanti et al. 2022 (arXiv
2205.05198, section 4.2.2): SP replaces each all-reduce by a reduce-scatter plus an all-gather of
the same payload, so the volume is equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sp_harness.capture.comm import CommRow


def ring_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for a ring implementation of the collective."""
    if group_size <= 1:
        return 0.0
    frac = (group_size - 1) / group_size
    if kind == "all_reduce":
        return 2 * frac * payload
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return frac * payload
    return float(payload)


@dataclass(kw_only=True, frozen=True)
class Volume:
    """Collectives of one kind over a step's forward and backward."""

    count: int = 0
    bytes: int = 0
    ring_bytes: float = 0.0


def activation_volume(rows: Sequence[CommRow], *, group: str = "tp", group_size: int) -> dict[str, Volume]:
    """Forward+backward activation collectives over `group`: counts and ring bytes per kind."""
    out: dict[str, Volume] = {}
    for row in rows:
        if row.group != group or row.phase not in ("forward", "backward"):
            continue
        v = out.get(row.kind, Volume())
        out[row.kind] = Volume(count=v.count + row.count, bytes=v.bytes + row.bytes,
                               ring_bytes=v.ring_bytes + ring_bytes(row.kind, row.bytes, group_size))
    return out


@dataclass(kw_only=True, frozen=True)
class PaperComparison:
    """SP's activation collectives against its TP twin's, per step and rank."""

    tp: int
    tp_all_reduce: Volume
    sp_all_gather: Volume
    sp_reduce_scatter: Volume
    tp_ring_bytes: float
    sp_ring_bytes: float
    sp_other_kinds: tuple[str, ...]
    """Collective kinds SP uses besides all-gather and reduce-scatter."""
    matches: bool
    """Each all-reduce replaced by a reduce-scatter + all-gather of the same payload."""

    @property
    def ratio(self) -> float:
        return self.sp_ring_bytes / self.tp_ring_bytes if self.tp_ring_bytes else float("inf")

    def describe(self) -> str:
        ar, ag, rs = self.tp_all_reduce, self.sp_all_gather, self.sp_reduce_scatter
        msg = (f"communication per step per rank (ring bytes): TP {self.tp_ring_bytes:.0f} "
               f"({ar.count} all-reduce, payload {ar.bytes} B) vs TP+SP {self.sp_ring_bytes:.0f} "
               f"({ag.count} all-gather {ag.bytes} B + {rs.count} reduce-scatter {rs.bytes} B)")
        if self.sp_other_kinds:
            msg += f", SP also uses {list(self.sp_other_kinds)}"
        if self.matches:
            return msg + ": equal, as the paper says"
        return msg + f": NOT equal (SP/TP {self.ratio:.3f}; paper: each all-reduce = reduce-scatter + all-gather)"


def paper_check(tp_rows: Sequence[CommRow], sp_rows: Sequence[CommRow], *, tp: int) -> PaperComparison:
    """Korthikanti et al.: SP turns each TP all-reduce into a reduce-scatter + all-gather of the
    same payload, so per-rank ring volume is equal."""
    tp_vol = activation_volume(tp_rows, group_size=tp)
    sp_vol = activation_volume(sp_rows, group_size=tp)
    ar = tp_vol.get("all_reduce", Volume())
    ag = sp_vol.get("all_gather", Volume())
    rs = sp_vol.get("reduce_scatter", Volume())
    tp_ring = sum(v.ring_bytes for v in tp_vol.values())
    sp_ring = sum(v.ring_bytes for v in sp_vol.values())
    matches = ar.count == ag.count == rs.count and ar.bytes == ag.bytes == rs.bytes and tp_ring == sp_ring
    return PaperComparison(tp=tp, tp_all_reduce=ar, sp_all_gather=ag, sp_reduce_scatter=rs, tp_ring_bytes=tp_ring,
                           sp_ring_bytes=sp_ring, sp_other_kinds=tuple(sorted(set(sp_vol) - {"all_gather", "reduce_scatter"})),
                           matches=matches)
