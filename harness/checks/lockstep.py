"""Stage: checks. Lockstep training: the case under test, its baseline (`Case.baseline`) and the
single-device reference trained from one initial state on the case's batch stream
(`Case.training`), gated against the bands (and a golden curve where given). As a check (a
short run of every case that declares a baseline) it catches bugs no single step shows, a
clipping norm that counts replicas, say, which the side-by-side check judges away by
re-anchoring every step; `sp-harness converge` runs it long and writes the report. The runs
and their gate are sp_harness.train.lockstep_runs.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from sp_harness.checks.base import Outcome
from sp_harness.config.case import Case, get_case
from sp_harness.config.check_config import CheckConfig
from sp_harness.train.lockstep_runs import run_lockstep


@dataclass(kw_only=True, frozen=True)
class ConvergeOptions:
    case: str = "megatron-gpt-sp"
    """The case under test (a registry name or path/to/file.py:NAME)."""
    baseline: str | None = None
    """The baseline case trained beside it; None: the case's own `Case.baseline`; '': none."""
    world_size: int = 2
    """Ranks of the baseline and case runs."""
    dp: int = 1
    """Data-parallel degree of the baseline and case runs."""
    steps: int = 200
    """Optimizer steps."""
    seq_len: int | None = None
    """Sequence length; None: the case's convergence default (`Training.seq_len`: 32 for the GPT
    cases), else its check default."""
    batch: int | None = None
    """Sequences per DP replica and step; None: the case's convergence default
    (`Training.batch`: 8 for the GPT cases), else its check default."""
    dtype: str = "float32"
    """Training dtype of every run (the gate's bands follow it)."""
    optimizer: str = "adamw"
    """'adamw' or 'sgd'."""
    lr: float = 1e-2
    """Peak learning rate."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    clip_grad_norm: float | None = 1.0
    """Global grad-norm clipping; None: off."""
    seed: int = 0
    """Initial weights."""
    data_seed: int = 1234
    """The batch stream (and, for the GPT cases, the Markov chain)."""
    timeout_s: float = 120.0
    """Seconds per job (setup, or one chunk of steps) before it counts as hung."""

    def baseline_case(self) -> str:
        return get_case(self.case).baseline if self.baseline is None else self.baseline


# option field -> its flag where the flag is not the field's name; the value a None takes
_FLAGS = {"timeout_s": "--timeout"}
_NONE_ARG = {"clip_grad_norm": "0"}


def repro_line(command: str, opts, *positional: str, **extra) -> str:
    """The `sp-harness` command line that repeats a run: every field of the options dataclass
    `opts` that differs from its default (floats by repr, so they parse back bit for bit), then
    the `extra` flags that are not None. The report directory is not part of it."""
    default = type(opts)()
    args = ["sp-harness", command, *positional]
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if value != getattr(default, f.name):
            args += [_FLAGS.get(f.name, "--" + f.name.replace("_", "-")), _arg(f.name, value)]
    for name, value in extra.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), _arg(name, value)]
    return shlex.join(args)


def _arg(name: str, value) -> str:
    if value is None:
        return _NONE_ARG[name]
    return repr(value) if isinstance(value, float) else str(value)


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

    def run(self, config: CheckConfig, runner) -> Outcome:
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
