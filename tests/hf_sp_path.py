"""What the Trainer's SP-path tests share (tests/test_hf_trainer_sp.py, tests/test_trl.py): the DP 2
x SP 2 config, and the verdict a correct case must have where the installed releases lack the SP
path or the flag a loss already scaled for accumulation needs. Asked in a child interpreter
(`releases.probe`): the test process imports no framework."""

import functools

from sp_harness.cases.frameworks import releases
from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import UNSUPPORTED
from sp_harness.report.result_text import format_result

TIMEOUT_S = 180.0
"""Generous for a loaded runner: DeepSpeed's, transformers' (and TRL's) imports are the case's setup."""

COMPAT = "sp_harness.cases.frameworks.hf.compat"


def sp_config(case: str, **fields) -> CheckConfig:
    """DP 2 x SP 2, K=2, two steps, AdamW in float32 unless `fields` say otherwise."""
    fields = {"optimizer": "adamw", "dtype": "float32", "steps": 2, **fields}
    return CheckConfig(case=case, world_size=4, dp=2, train_step=True, micro_batches=2, timeout_s=TIMEOUT_S,
                       **fields)


@functools.cache
def _gaps(function: str) -> tuple[str, ...]:
    return releases.probe(COMPAT, function)


def runs_here(res, *, scaled_loss: bool = False) -> bool:
    """True where the installed releases have the SP path (and, `scaled_loss`, for a user's loss
    already scaled for accumulation, the Trainer's `loss_is_scaled_for_ga`: 5.3.0 divides such a
    loss by K again): the test goes on. Else asserts `res` is UNSUPPORTED naming what is missing."""
    if _gaps("sp_missing"):
        assert res.verdict == UNSUPPORTED and "sequence parallelism" in res.reason, format_result(res)
        return False
    if scaled_loss and _gaps("scaled_loss_missing"):
        assert res.verdict == UNSUPPORTED and "loss_is_scaled_for_ga" in res.reason, format_result(res)
        return False
    return True
