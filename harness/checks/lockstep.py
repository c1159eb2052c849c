"""Stage: checks. Lockstep training: the case under test, its baseline (`Case.baseline`) and the
single-device reference trained from one initial state on the case's batch stream
(`Case.training`), gated against the bands (and a golden curve where given). As a check (a
short run of every case that declares a baseline) it catches bugs no single step shows, a
clipping norm that counts replicas, say, which the side-by-side check judges away by
re-anchoring every step; `sp-harness converge` runs it long and writes the report. The runs
and their gate are sp_harness.train.lockstep_runs.
"""

from __future__ import annotations

from sp_harness.checks.base import Outcome
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.converge_options import ConvergeOptions, repro_line  # noqa: F401 (re-exported)
from sp_harness.launch.runner import Runner
from sp_harness.train.lockstep_runs import run_lockstep

STEPS, SEQ_LEN, BATCH, WARMUP = 6, 12, 2, 2
"""The check's run: long enough for the LR warmup to end and clipping to bite; short enough for
every mutant."""


class Lockstep:
    name = "lockstep"
    label = "lockstep gate"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        if not case.baseline:
            return f"{case.name} declares no baseline to train beside"
        return None

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        opts = ConvergeOptions(case=config.case, world_size=config.world_size, steps=STEPS, seq_len=SEQ_LEN,
                               batch=BATCH, warmup_steps=WARMUP)
        run = run_lockstep(opts, runner, progress=False)
        repro = repro_line("converge", opts)
        if run.result.passed:
            return Outcome(check=self.name, status="pass", repro=repro, figures=run.result)
        res = run.result
        detail = f"first failing step {res.first_failing_step}, {res.first_failing_metric}"
        if res.first_failing_param:
            detail += f" ({res.first_failing_param})"
        return Outcome(check=self.name, status="fail", caught_by=self.label, detail=detail, repro=repro,
                       figures=res)

    def render(self, outcome: Outcome) -> str:
        return f"lockstep: {outcome.status} {outcome.detail}".rstrip()


CHECK = Lockstep()
