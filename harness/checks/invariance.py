"""Stage: checks. What the two training-step invariance checks share: running the rank job
(sp_harness.checks.invariance_rank) and judging two variants of one step against each other,
each within the bound the tolerance model holds a correct run to, so the pair within the sum."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sp_harness.checks.base import Outcome
from sp_harness.checks.invariance_rank import InvariancePayload, InvarianceResult, Variant, run_rank
from sp_harness.checks.train_step import require_train_step
from sp_harness.config.case import Case, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.launch.failure import RankFailure, SetupError
from sp_harness.launch.runner import Runner


@dataclass(kw_only=True)
class Difference:
    what: str
    """'reported loss' or a reference param name (its grad)."""
    max_abs: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.bound

    def describe(self) -> str:
        kind = "" if self.what == "reported loss" else "grad "
        return f"{kind}{self.what}: differ by {self.max_abs:.3g} > {self.bound:.3g} (the two runs' bounds summed)"


@dataclass(kw_only=True)
class InvarianceFigures:
    """What an invariance check compared (its `Outcome.figures`)."""

    left: str
    right: str
    differences: list[Difference] = field(default_factory=list)
    """Every compared quantity, the reported loss first."""

    @property
    def failures(self) -> list[Difference]:
        return [d for d in self.differences if not d.ok]


def compare(left: Variant, right: Variant, left_name: str, right_name: str) -> InvarianceFigures:
    out = InvarianceFigures(left=left_name, right=right_name)
    out.differences.append(Difference(what="reported loss", max_abs=abs(left.loss - right.loss),
                                      bound=left.loss_bound + right.loss_bound))
    for name in sorted(left.grads):
        a, b = left.grads[name], right.grads[name]
        err = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
        out.differences.append(Difference(what=name, max_abs=err, bound=left.bounds[name] + right.bounds[name]))
    return out


class TwinCrashed(Exception):
    """The check's own counterpart of the run (degree invariance's one-rank twin) crashed where the
    case's step on its own mesh ran: the check could not compare (ERROR), no defect is shown."""


def prepared(case: Case, config: CheckConfig) -> CheckConfig | str:
    """The resolved train-step config, or why it is UNSUPPORTED; ValueError for a setup error."""
    config = case.resolve(config.replace(train_step=True, steps=1))
    try:
        case.validate(config)
        require_train_step(case, config)
    except Unsupported as exc:
        return str(exc)
    return config


def run_variant(runner: Runner, payload: InvariancePayload, label: str) -> InvarianceResult:
    config = payload.config
    assert config.timeout_s is not None, "Case.resolve fills timeout_s"
    results = runner.run(config.world_size, run_rank, payload, timeout_s=config.timeout_s, label=label,
                         case=config.case)
    assert results[0] is not None, "rank 0 returns the variants"
    return results[0]


class InvarianceCheck:
    """What both invariance checks share: n/a without a declared step, the config resolved as
    the training-step check resolves it (one step), a crash of the case's step as a fail (of the
    check's own twin of it, an error: `TwinCrashed`), the figures rendered.
    A subclass names itself and says how it runs and compares its two variants."""

    name: str
    label: str

    def why_not(self, config: CheckConfig) -> str | None:
        """Why the check does not apply to `config` beyond a missing step; None where it does."""
        return None

    def compare_runs(self, case: Case, ready: CheckConfig, runner: Runner, label: str) -> InvarianceFigures | str:
        """Run the two variants and compare them; a string says why they cannot run (n/a)."""
        raise NotImplementedError

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        if case.train_loss is None:
            return f"case {case.name} declares no training step (Case.train_loss)"
        return self.why_not(config)

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        t0 = time.perf_counter()
        case = get_case(config.case)
        ready = prepared(case, config)
        if isinstance(ready, str):
            return Outcome(check=self.name, status="n/a", detail=ready)
        try:
            figures = self.compare_runs(case, ready, runner, f"case {config.case} [{ready.short()}] ({self.name})")
        except SetupError as exc:  # Case.setup: nothing of the step ran
            if why := exc.unsupported(ready.world_size):
                return Outcome(check=self.name, status="n/a", detail=f"case {ready.case} {why}")
            return Outcome(check=self.name, status="error", caught_by="setup", detail=str(exc), repro=ready.repro())
        except RankFailure as exc:
            if all(e.is_unsupported for e in exc.errors):  # the step declared the variant out of reach
                return Outcome(check=self.name, status="n/a", detail=exc.errors[0].message or exc.one_line())
            if exc.in_setup:  # before the first accumulation: the check could not run
                return Outcome(check=self.name, status="error", caught_by="setup", detail=exc.one_line(),
                               repro=ready.repro())
            return Outcome(check=self.name, status="fail", caught_by="crash", detail=exc.one_line(),
                           repro=ready.repro())
        except TwinCrashed as exc:
            return Outcome(check=self.name, status="error", caught_by="twin", detail=str(exc), repro=ready.repro())
        if isinstance(figures, str):
            return Outcome(check=self.name, status="n/a", detail=figures)
        if figures.failures:
            return Outcome(check=self.name, status="fail", caught_by=f"{figures.left} vs {figures.right}",
                           detail=figures.failures[0].describe(), repro=ready.repro(), figures=figures)
        return Outcome(check=self.name, status="pass", detail=f"{time.perf_counter() - t0:.1f}s",
                       repro=ready.repro(), figures=figures)

    def render(self, outcome: Outcome) -> str:
        figures = outcome.figures
        if figures is None:
            return f"{outcome.status.upper()}: {outcome.detail}"
        lines = [f"{outcome.check}: {figures.left} vs {figures.right}"]
        worst = max(figures.differences, key=lambda d: d.max_abs / d.bound if d.bound else float("inf") if d.max_abs
                    else 0.0)
        lines.append(f"  largest difference against its bound: {worst.what} {worst.max_abs:.3g} (bound {worst.bound:.3g})")
        lines += [f"  FAIL {d.describe()}" for d in figures.failures[:8]]
        lines.append("PASS" if not figures.failures else f"FAIL ({len(figures.failures)} of {len(figures.differences)})")
        return "\n".join(lines)


__all__ = ["InvarianceCheck", "InvarianceFigures", "compare", "prepared", "run_variant"]
