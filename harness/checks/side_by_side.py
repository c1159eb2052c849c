"""Stage: checks. The side-by-side check: the sharded model stepped beside its references on real
ranks; outputs, loss, input grads, param grads and params after each optimizer step judged per
rank, replicated params compared bit for bit. `check(config)` runs the rank job
(sp_harness.checks.side_by_side_rank) and hands the ranks' results to the verdict
(sp_harness.judge.verdict)."""

from __future__ import annotations

import time
from collections.abc import Callable

from sp_harness.checks.base import Outcome, status_line
from sp_harness.checks.side_by_side_rank import run_rank
from sp_harness.config.case import Case, ParamMappingError, Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.judge.verdict import ERROR, FAIL, UNSUPPORTED, CheckResult, RankResult, merge
from sp_harness.launch.failure import RankFailure, SetupError
from sp_harness.launch.runner import Runner, default_manager


def resolve(config: CheckConfig) -> CheckConfig:
    """`config` with its case's defaults filled in, as `check` runs it."""
    return get_case(config.case).resolve(config)


def check(config: CheckConfig, runner: Runner | None = None) -> CheckResult:
    """Run one side-by-side check of `config` and return its verdict. Never raises on FAIL."""
    return run_job(config, runner, run_rank)


def run_job(config: CheckConfig, runner: Runner | None, job: Callable[[CheckConfig], RankResult], *,
            validate: Callable[[Case, CheckConfig], None] = lambda case, config: None) -> CheckResult:
    """Resolve and validate `config` (the case's `validate`, then `validate`), run `job` on every
    rank and merge the ranks' results into one verdict: the one path of every check whose rank
    job returns a `RankResult`. Never raises on FAIL."""
    t0 = time.perf_counter()
    case = get_case(config.case)
    config = case.resolve(config)
    try:
        case.validate(config)
        validate(case, config)
    except Unsupported as exc:
        return CheckResult(config=config, verdict=UNSUPPORTED, reason=str(exc), wall_s=time.perf_counter() - t0)
    runner = runner or default_manager()
    label = f"case {config.case} [{config.short()}]"
    assert config.timeout_s is not None, "Case.resolve fills timeout_s"
    try:
        results: list[RankResult] = runner.run(config.world_size, job, config,
                                               timeout_s=config.timeout_s, label=label, case=config.case)
    except SetupError as exc:  # the case's per-process setup (Case.setup): nothing of the code ran
        if why := exc.unsupported(config.world_size):
            return CheckResult(config=config, verdict=UNSUPPORTED, reason=f"case {config.case} {why}",
                               wall_s=time.perf_counter() - t0)
        failure = exc.failure
        return CheckResult(config=config, verdict=ERROR, reason=str(exc),
                           error=failure.describe() if failure else str(exc), crash_kind=failure.kind if failure else "",
                           rank_errors=failure.errors if failure else (), wall_s=time.perf_counter() - t0)
    except RankFailure as exc:
        if exc.errors[0].kind == "raised" and exc.errors[0].exc_type == ParamMappingError.__name__:
            # a param the shapes cannot place (sp_harness.step.params.checked_spec): the user's
            # mapping to fix, not a verdict; one line, as the CLI reports a ValueError (the lowest
            # rank's: each rank names its own piece, and the first to raise varies run to run)
            first = min((e for e in exc.errors if e.exc_type == ParamMappingError.__name__), key=lambda e: e.rank)
            raise ParamMappingError(f"case {config.case}: {first.message}") from None
        if exc.every_rank_unsupported(config.world_size):
            return CheckResult(config=config, verdict=UNSUPPORTED, reason=exc.errors[0].message or exc.summary_line(),
                               wall_s=time.perf_counter() - t0)
        # before the first step the code under test has not run: a setup that could not run
        return CheckResult(config=config, verdict=ERROR if exc.in_setup else FAIL, reason=exc.one_line(),
                           error=exc.describe(), crash_kind=exc.kind, rank_errors=exc.errors,
                           wall_s=time.perf_counter() - t0)
    return merge(config, results, wall_s=time.perf_counter() - t0, declared=case.precision_islands)


KIND_LABEL = {"init": "init", "forward": "forward", "lse": "attention lse", "loss": "forward (loss)", "input_grad": "input grad", "grad": "grad",
              "param": "param-after-step"}
"""Table names of the tensor checks (CheckResult.first_check); other parts keep their own."""


def outcome_of(res: CheckResult, name: str = "side-by-side") -> Outcome:
    if res.verdict == UNSUPPORTED:  # the case's own declaration, shown as its verdict
        return Outcome(check=name, status="n/a", detail=res.reason, repro=res.config.repro(), figures=res)
    if res.verdict == ERROR:
        return Outcome(check=name, status="error", caught_by="setup", detail=res.reason, repro=res.config.repro(),
                       figures=res)
    if res.verdict == FAIL:
        kind = res.first_check
        return Outcome(check=name, status="fail", caught_by=KIND_LABEL.get(kind, kind) or "?",
                       detail=res.first_failure, repro=res.config.repro(), figures=res)
    return Outcome(check=name, status="pass", repro=res.config.repro(), figures=res)


class SideBySide:
    name = "side-by-side"
    label = "side-by-side"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        if config.train_step:
            return "the config asks for the case's own training step (the train-step check)"
        return None  # a case declares what it cannot run through `validate` (UNSUPPORTED)

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        return outcome_of(check(config, runner), self.name)

    def render(self, outcome: Outcome) -> str:
        # its figures are a CheckResult, whose table report/ renders (Check.render)
        return status_line(outcome)


CHECK = SideBySide()
