"""Stage: checks. Accumulation invariance: the case's own step over K micro-batches against the
same step over the same global batch as one micro-batch, from the same params (TRL's invariance
tests, with bounds derived from the tolerance model instead of fixed ones). A step that normalises
per micro-batch or drops one fails here, without a reference model to trust."""

from __future__ import annotations

from sp_harness.checks.invariance import InvarianceCheck, InvarianceFigures, compare, run_variant
from sp_harness.checks.invariance_rank import InvariancePayload
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.launch.runner import Runner


class AccumulationInvariance(InvarianceCheck):
    name = "accumulation-invariance"
    label = "accumulation invariance"

    def why_not(self, config: CheckConfig) -> str | None:
        if config.micro_batches < 2:
            return f"micro_batches({config.micro_batches}) < 2: nothing to accumulate"
        return None

    def compare_runs(self, case: Case, ready: CheckConfig, runner: Runner, label: str) -> InvarianceFigures:
        result = run_variant(runner, InvariancePayload(config=ready, single=True), label)
        assert result.single is not None, "single=True runs the one-micro-batch variant"
        return compare(result.micro, result.single, f"K={ready.micro_batches} micro-batches", "one batch")


CHECK = AccumulationInvariance()
