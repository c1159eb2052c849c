"""sp-harness: prove a sequence-parallel model agrees with its single-device reference.

The flow, bottom to top, is `sp_harness.stages.STAGES`: each stage is a folder of `harness/`.
The public API for users' own cases is re-exported here.
"""

from sp_harness.config.case import Batch, Case, Example, Layout, ParamSpec, Sharded, Training, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant, register


def check(config: CheckConfig, runner=None):
    """Run one side-by-side check; returns a CheckResult (verdict PASS / FAIL / UNSUPPORTED / ERROR)."""
    from sp_harness.checks.side_by_side import check as _check

    return _check(config, runner)


__all__ = ["Batch", "Case", "CheckConfig", "Example", "Layout", "ParamSpec", "RankContext", "Sharded", "Training",
           "Unsupported", "check", "mutant", "register"]
