"""Stage: checks. What a check is: a name, which configs it applies to, and a run that returns an
`Outcome` carrying the check's own figures.

`sp-harness check`, the mutant battery, the benchmark and the reports all take the checks from
one list (`sp_harness.checks.all_checks`); adding a check is adding one module to this package
that defines `CHECK`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.launch.runner import Runner

Status = Literal["pass", "fail", "error", "n/a"]


@dataclass(kw_only=True, frozen=True)
class Outcome:
    """What one check concluded on one config."""

    check: str
    """The check's name."""
    status: Status
    """'pass', 'fail' (a defect of the code under test), 'error' (the check could not run: a crash
    before the code's first step; it says nothing about the code), or 'n/a' where the check does
    not apply (or the case declared the config UNSUPPORTED)."""
    caught_by: str = ""
    """For a fail: the part of the check that caught it first ('grad', 'replica drift', 'crash',
    'collective accounting', ...)."""
    detail: str = ""
    """One line: the first failure, or why the check does not apply."""
    repro: str = ""
    """The one-line command that reruns exactly this check."""
    figures: Any = None
    """The check's own result dataclass (CheckResult, PaperComparison, MemoryReport, ...)."""
    skipped: bool = False
    """For an n/a: the check was asked for but not run, because the check it builds on did not
    pass (`detail` says which and how); False where it does not apply to the config."""

    @property
    def passed(self) -> bool | None:
        """True for a pass, False for a fail, None where nothing was judged (n/a, error)."""
        return None if self.status in ("n/a", "error") else self.status == "pass"


def not_applicable(check: str, why: str, repro: str = "") -> Outcome:
    return Outcome(check=check, status="n/a", detail=why, repro=repro)


def status_line(outcome: Outcome) -> str:
    """An outcome in one line: the render of a check whose figures report/ renders itself."""
    return f"{outcome.check} {outcome.status.upper()}" + (f": {outcome.detail}" if outcome.detail else "")


def run_check(check: "Check", config: CheckConfig, runner: Runner) -> Outcome:
    """The one way a check runs: n/a where it does not apply to the case and config, else its run."""
    from sp_harness.config.registry import get_case

    why = check.applies(get_case(config.case), config)
    if why is not None:
        return not_applicable(check.name, why)
    return check.run(config, runner)


@runtime_checkable
class Check(Protocol):
    """A pluggable check (the pytest-xdist `Scheduling` pattern: a Protocol, not a base class)."""

    name: str
    """Stable identifier: battery entries and `--json` records name checks by it."""
    label: str
    """How a fail is named in tables ('collective accounting')."""

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        """None where the check applies to `config` of `case`, else why not (one line)."""

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        """Run the check where it applies (callers go through `run_check`) on a runner (a
        PoolManager or the torchrun world); never raises on a fail."""

    def render(self, outcome: Outcome) -> str:
        """The human text of an outcome whose figures are this check's own type (or None).

        One rendering per figures type: a type the checks share lives in report/ and is rendered
        there before a check is asked (`CheckResult`, the figures of the side-by-side and
        training-step checks: sp_harness.report.result_text, applied by
        sp_harness.report.text.format_outcomes), since checks/ sits below report/ and may not
        import its text; such a check's render is its `status_line`."""
