"""Two ring-gpt bugs the default battery cannot see, so NOT registered as catalogue mutants (the
catalogue is what the battery must kill): the non-causal one needs causal=False (the battery runs
ring-gpt causal), the placement one is numerically correct (only the balance accounting sees it).
tests/test_ring.py kills both, loading them by path (`cases/mutants/ring_blind_mutants.py:NAME`,
which ranks can load too; this file registers nothing, so loading it again is harmless).
"""

from __future__ import annotations

import dataclasses

from sp_harness.cases.ring.attention import CORRECT
from sp_harness.cases.ring.cases import RING, ring_shard
from sp_harness.cases.ring.placement import block_mask, contiguous_order
from sp_harness.config.case import Case


def blind_mutant(name: str, summary: str, bug: str, *, source: str, **swap) -> Case:
    """Like `ring_mutant`, not registered: a bug the default battery cannot see (see above)."""
    return dataclasses.replace(
        RING, name=name, description=f"MUTANT {RING.name}: {summary}", models_bug=bug, source=source,
        twin=RING.name, tags=RING.tags + ("mutant", "battery-blind"), examples=(),
        shard=ring_shard(dataclasses.replace(CORRECT, **swap)))


# (b) only causal=False with load_balancer='zigzag': the mask assumes causal attention whenever
# the load balancer is on. The battery runs causal; pinned in tests/test_ring.py.
CAUSAL_UNDER_BALANCER = blind_mutant(
    "mutant-ring-balancer-assumes-causal",
    "causal mask applied under the zigzag balancer even for causal=False",
    "load-balanced (zigzag) ring attention written for causal attention only: with is_causal=False "
    "the balanced path still masks as if causal (pytorch/pytorch#141429 'non-causal ring attention "
    "broken' with enable_load_balance; the fix asserted the combination unsupported, PR #141622)",
    source="pytorch/pytorch#141429; pytorch/pytorch#141622",
    mask=lambda q_pos, k_pos, causal, balancer: block_mask(q_pos, k_pos, causal or balancer == "zigzag"),
)

# (f) numerically correct: plain contiguous placement while load_balancer says zigzag. Only the
# balance accounting sees it (tests/test_ring.py pins that), no tensor check can.
UNBALANCED = blind_mutant(
    "mutant-ring-zigzag-unbalanced",
    "contiguous causal shards claimed as zigzag (correct numbers, rank W-1 does ~2W-1x rank 0's work)",
    "load balancer whose rearrangement does not survive the contiguous cut, here in its simplest "
    "form (the identity): with causal attention the last rank scores ~2W-1 times the first rank's "
    "pairs. Outputs stay exactly right, so no tensor check can see it (pytorch/pytorch PR #189902: "
    "the per-document head-tail balancer laid its indices out document-major, CP cut them "
    "contiguously, and some ranks inherited a document's whole causal tail; 'the existing "
    "correctness tests never caught it')",
    source="pytorch/pytorch PR #189902",
    placement=lambda balancer: contiguous_order,
)
