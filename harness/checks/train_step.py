"""Stage: checks. The training-step check: the case's own training step (loss normalisation,
gradient accumulation over K micro-batches, grad sync, clipping, optimizer) against the loss it
declares, in float64 on one device over the whole global batch. The rank job and its stages:
sp_harness.checks.train_step_rank. It runs where the config asks for it (`train_step=True`,
`sp-harness check --train-step`); the side-by-side check runs everywhere else."""

from __future__ import annotations

from sp_harness.checks.base import Outcome, status_line
from sp_harness.checks.side_by_side import KIND_LABEL, outcome_of, run_job
from sp_harness.checks.train_step_rank import run_rank
from sp_harness.config.case import Case, Unsupported, as_batch
from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import CheckResult
from sp_harness.launch.runner import Runner
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
    from sp_harness.config.registry import all_cases

    return sorted(n for n, c in all_cases().items() if c.train_loss is not None and "mutant" not in c.tags)


def check(config: CheckConfig, runner: Runner | None = None) -> CheckResult:
    """Run one training-step check of `config` (its `train_step` is set here); never raises on FAIL."""
    return run_job(config.replace(train_step=True), runner, run_rank, validate=require_train_step)


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
        # its figures are a CheckResult, whose table report/ renders (Check.render)
        return status_line(outcome)


CHECK = TrainStepCheck()
