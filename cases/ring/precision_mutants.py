"""Stage: config and step. Ring attention's low-precision mutant: zigzag-placed position ids cast
to the run dtype, exact in float32/64, aliased in bfloat16 past 256 tokens (the class:
sp_harness.cases.common_mutants)."""

from __future__ import annotations

from sp_harness.cases.common_mutants import POSITIONS_SOURCES, positions_input_through, run_dtype
from sp_harness.cases.ring.cases import RING, ring_shard
from sp_harness.config.registry import mutant

RING_POSITIONS_BF16 = mutant(
    RING,
    name="mutant-ring-positions-bf16",
    summary="zigzag-placed position ids cast to the run dtype (bf16) before embedding",
    bug="a context-parallel rank's position ids (under zigzag both ends of the sequence, so every "
        "rank holds positions past 256) cast to the model dtype with the inputs and back to "
        "indices: in bfloat16 they alias, tokens embed a neighbour's position (the "
        "positions-in-low-precision class: transformers#25681, PR #29285, UNI-D2 PR #6). "
        "Exact in float32/64",
    source=POSITIONS_SOURCES,
    tags=("ring", "low-precision"),
    shard=lambda ref, ctx: positions_input_through(run_dtype(ref), ring_shard())(ref, ctx),
    killed_by=("forward", "bf16"),
)
