"""Stage: checks. The training-step check: the case's own training step (loss normalisation,
gradient accumulation over K micro-batches, grad sync, clipping, optimizer) against the loss it
declares, in float64 on one device over the whole global batch. The rank job and its stages:
sp_harness.checks.train_step_rank. It runs where the config asks for it (`train_step=True`,
`sp-harness check --train-step`); the side-by-side check runs everywhere else."""

from __future__ import annotations

import time

from sp_harness.checks.base import Outcome
from sp_harness.checks.side_by_side import KIND_LABEL, outcome_of
from sp_harness.checks.train_step_rank import run_rank
from sp_harness.config.case import Case, Unsupported, as_batch, get_case
from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import FAIL, UNSUPPORTED, CheckResult, RankResult, format_result, merge
from sp_harness.launch.failure import RankFailure
from sp_harness.launch.runner import Runner, default_manager
from sp_harness.step.inputs import batch_generator

NAME = "train-step"
STAGE_LABEL = {**KIND_LABEL, "loss": "reported loss", "grad": "grads before clipping", "grad_norm": "grad norm",
               "clip": "clip coefficient", "param": "update given the grads"}
"""Table names of the stages, in the order they are judged."""


def require_train_step(case: Case, config: CheckConfig) -> None:
    """ValueError (a setup error, exit 2) for a config the training-step check cannot run at all;
    `Unsupported` for one the case declares it cannot. In the driver, before any rank starts."""
    if case.train_loss is None:
        raise ValueError(f"case {case.name} declares no training step (Case.train_loss is None); "
                         f"cases that do: {', '.join(train_step_cases()) or 'none'}")
    if case.input_layout.batch_dim is None:
        raise Unsupported(f"case {case.name}: its input has no batch dim (Case.input_layout), so K micro-batches "
                          f"cannot be one global batch")
    ignore = case.train_loss.ignore_index
    made = as_batch(case.make_batch(config, 0, batch_generator(config.seed)))
    if bool((made.target == ignore).all()):
        raise ValueError(f"case {case.name} [{config.short()}]: every target of its batch is the ignore index "
                         f"{ignore}: the global batch holds no valid token (lower prompt_len, raise seq_len)")


def train_step_cases() -> list[str]:
    from sp_harness.config.case import all_cases

    return sorted(n for n, c in all_cases().items() if c.train_loss is not None and "mutant" not in c.tags)


def check(config: CheckConfig, runner: Runner | None = None) -> CheckResult:
    """Run one training-step check of `config` (its `train_step` is set here); never raises on FAIL."""
    t0 = time.perf_counter()
    case = get_case(config.case)
    config = case.resolve(config.replace(train_step=True))
    try:
        case.validate(config)
        require_train_step(case, config)
    except Unsupported as exc:
        return CheckResult(config=config, verdict=UNSUPPORTED, reason=str(exc), wall_s=time.perf_counter() - t0)
    runner = runner or default_manager()
    label = f"case {config.case} [{config.short()}]"
    assert config.timeout_s is not None, "Case.resolve fills timeout_s"
    try:
        results: list[RankResult] = runner.run(config.world_size, run_rank, config, timeout_s=config.timeout_s,
                                               label=label, case=config.case)
    except RankFailure as exc:
        if len(exc.errors) == config.world_size and all(e.is_unsupported for e in exc.errors):
            return CheckResult(config=config, verdict=UNSUPPORTED, reason=exc.errors[0].message or exc.summary_line(),
                               wall_s=time.perf_counter() - t0)
        return CheckResult(config=config, verdict=FAIL, reason=exc.one_line(), error=exc.describe(),
                           crash_kind=exc.kind, rank_errors=exc.errors, wall_s=time.perf_counter() - t0)
    return merge(config, results, wall_s=time.perf_counter() - t0, declared=case.precision_islands)


class TrainStepCheck:
    name = NAME
    label = "training step"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        if case.train_loss is None:
            return f"case {case.name} declares no training step (Case.train_loss)"
        return None

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        res = check(config, runner)
        outcome = outcome_of(res, self.name)
        if outcome.status == "fail" and res.failures:
            return Outcome(check=outcome.check, status="fail", caught_by=STAGE_LABEL.get(res.first_check, res.first_check),
                           detail=res.reason.partition("; first: ")[2] or outcome.detail, repro=outcome.repro,
                           figures=res)
        return outcome

    def render(self, outcome: Outcome) -> str:
        if outcome.figures is None:
            return f"UNSUPPORTED: {outcome.detail}"
        return format_result(outcome.figures)


CHECK = TrainStepCheck()
