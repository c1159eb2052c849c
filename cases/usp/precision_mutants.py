"""Stage: config and step. The Ulysses x ring hybrid's low-precision mutant: position ids cast to
the run dtype, exact in float32/64, aliased in bfloat16 past 256 tokens (the class:
sp_harness.cases.common_mutants)."""

from __future__ import annotations

from sp_harness.cases.common_mutants import POSITIONS_SOURCES, positions_input_through, run_dtype
from sp_harness.cases.usp.cases import USP, usp_shard
from sp_harness.config.registry import mutant

USP_POSITIONS_BF16 = mutant(
    USP,
    name="mutant-usp-positions-bf16",
    summary="hybrid Ulysses x ring: position ids cast to the run dtype (bf16) before embedding",
    bug="a hybrid (Ulysses x ring) rank's position ids cast to the model dtype with the inputs and "
        "back to indices: in bfloat16 positions past 256 alias and tokens embed a neighbour's "
        "position (the positions-in-low-precision class: transformers#25681, PR #29285, UNI-D2 "
        "PR #6). Exact in float32/64",
    source=POSITIONS_SOURCES,
    tags=("low-precision",),
    shard=lambda ref, ctx: positions_input_through(run_dtype(ref), usp_shard())(ref, ctx),
    killed_by=("forward", "bf16"),
)
