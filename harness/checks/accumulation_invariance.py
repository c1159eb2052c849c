"""Stage: checks. Accumulation invariance: the case's own step over K micro-batches against the
same step over the same global batch as one micro-batch, from the same params (TRL's invariance
tests, with bounds derived from the tolerance model instead of fixed ones). A step that normalises
per micro-batch or drops one fails here, without a reference model to trust."""

from __future__ import annotations

import time

from sp_harness.checks.base import Outcome
from sp_harness.checks.invariance import applies, compare, get_case, outcome, prepared, render, run_variant
from sp_harness.checks.invariance_rank import InvariancePayload
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.launch.failure import RankFailure
from sp_harness.launch.runner import Runner

NAME = "accumulation-invariance"


class AccumulationInvariance:
    name = NAME
    label = "accumulation invariance"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        why = applies(case)
        if why is None and config.micro_batches < 2:
            return f"micro_batches({config.micro_batches}) < 2: nothing to accumulate"
        return why

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        t0 = time.perf_counter()
        case = get_case(config.case)
        ready = prepared(case, config)
        if isinstance(ready, str):
            return Outcome(check=self.name, status="n/a", detail=ready)
        label = f"case {config.case} [{ready.short()}] ({self.name})"
        try:
            result = run_variant(runner, InvariancePayload(config=ready, single=True), label)
        except RankFailure as exc:
            return outcome(self.name, ready, None, error=exc, t0=t0)
        assert result.single is not None, "single=True runs the one-micro-batch variant"
        figures = compare(result.micro, result.single, f"K={ready.micro_batches} micro-batches", "one batch")
        return outcome(self.name, ready, figures, t0=t0)

    def render(self, outcome: Outcome) -> str:
        return render(outcome)


CHECK = AccumulationInvariance()
