"""Stage: checks. The side-by-side check: the sharded model stepped beside its references on real
ranks; outputs, loss, input grads, param grads and params after each optimizer step judged per
rank, replicated params compared bit for bit (sp_harness.checks.sidebyside on the ranks,
sp_harness.checks.verify on the driver)."""

from __future__ import annotations

from sp_harness.checks.base import Outcome
from sp_harness.checks.verify import FAIL, UNSUPPORTED, CheckResult, check, format_result
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig

KIND_LABEL = {"init": "init", "forward": "forward", "lse": "attention lse", "loss": "forward (loss)", "input_grad": "input grad", "grad": "grad",
              "param": "param-after-step"}
"""Table names of the tensor checks (CheckResult.first_check); other parts keep their own."""


def outcome_of(res: CheckResult, name: str = "side-by-side") -> Outcome:
    if res.verdict == UNSUPPORTED:  # the case's own declaration, shown as its verdict
        return Outcome(check=name, status="n/a", detail=res.reason, repro=res.config.repro(), figures=res)
    if res.verdict == FAIL:
        kind = res.first_check
        return Outcome(check=name, status="fail", caught_by=KIND_LABEL.get(kind, kind) or "?",
                       detail=res.first_failure, repro=res.config.repro(), figures=res)
    return Outcome(check=name, status="pass", repro=res.config.repro(), figures=res)


class SideBySide:
    name = "side-by-side"
    label = "side-by-side"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        return None  # a case declares what it cannot run through `validate` (UNSUPPORTED)

    def run(self, config: CheckConfig, runner) -> Outcome:
        return outcome_of(check(config, runner), self.name)

    def render(self, outcome: Outcome) -> str:
        if outcome.figures is None:
            return f"UNSUPPORTED: {outcome.detail}"
        return format_result(outcome.figures)


CHECK = SideBySide()
