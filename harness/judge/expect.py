"""Stage: gate (for generated configs). The verdict a built-in case should reach on a config.

Our own cases must PASS (or be declared UNSUPPORTED up front). PyTorch's DTensor styles are
pinned to what torch 2.13 does, measured and recorded in the README ("What it found"): the seed
plan and the torchtitan-style plan PASS only when every split is even; an uneven sequence
(DTensor.from_local assumes even shards) or an uneven column/row split (sharding propagation
rejects the mm) is a FAIL, and so, even on one rank, is a RowwiseParallel linear whose input
width is 1 (sharding propagation fails on `aten.view` of a [1, 1] Shard(1) grad; found by
hypothesis). If PyTorch changes any of this, the property tests say so.
"""

from __future__ import annotations

from sp_harness.config.case import Unsupported, get_case
from sp_harness.config.check_config import CheckConfig


def expected_verdict(config: CheckConfig) -> str:
    case = get_case(config.case)
    config = case.resolve(config)
    try:
        case.validate(config)
    except Unsupported:
        return "UNSUPPORTED"
    tp = config.tp
    if config.case == "seed-mlp":
        even = config.seq_len % tp == 0 and config.hidden % tp == 0
        return "PASS" if even and config.hidden > 1 else "FAIL"
    if config.case == "dtensor-gpt":
        # every split: the sequence, fc1/fc2's ffn, q/k/v and out-proj's hidden columns; and a
        # vocab of at least tp rows (2 rows over 3 ranks: AdamW's exp_avg.lerp_ fails sharding
        # propagation between an S(0) state and an R grad; 4 rows over 3, also 2/2/0, pass;
        # found by the false-alarm run, pinned as measured)
        even = (config.seq_len % tp == 0 and config.ffn % tp == 0 and config.hidden % tp == 0
                and config.vocab >= tp)
        return "PASS" if even and config.ffn > 1 and config.hidden > 1 else "FAIL"
    return "PASS"
