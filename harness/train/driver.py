"""Stage: train. Driver side: runs one lockstep training on a runner, in chunks of steps, with
a progress display, and returns every step's results; a crash or hang ends the run there."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from sp_harness.launch.failure import RankFailure
from sp_harness.train.rank import StepResult, train_end, train_start, train_steps
from sp_harness.train.spec import TrainSpec

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner

"""Module of the rank-side job functions."""


@dataclass
class Progress:
    """A progress bar per run on a terminal; a line per quarter in logs (CI)."""

    run: str
    total: int
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    _last_quarter: int = -1

    def update(self, done: int, loss: float) -> None:
        tty = getattr(self.stream, "isatty", lambda: False)()
        if tty:
            filled = int(30 * done / self.total)
            self.stream.write(f"\r  {self.run:<4} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} steps  loss {loss:.4f}")
            if done == self.total:
                self.stream.write("\n")
        else:
            quarter = 4 * done // self.total
            if quarter != self._last_quarter:
                self._last_quarter = quarter
                self.stream.write(f"  {self.run:<4} {done}/{self.total} steps  loss {loss:.4f}\n")
        self.stream.flush()


@dataclass(kw_only=True)
class TrainOutcome:
    """What one training run produced."""

    spec: TrainSpec
    steps: list[StepResult] = field(default_factory=list)
    """Results of the steps completed, in order."""
    failure: RankFailure | None = None
    """The crash or hang that ended the run early; None if it ran every step."""


def train(spec: TrainSpec, runner: Runner, *, chunk: int = 25, progress: bool = True,
          catch_failures: bool = False) -> TrainOutcome:
    """Run one lockstep training. A run that crashes or hangs stops there: with
    `catch_failures` its results so far come back with the failure, else the failure is raised."""
    cfg = spec.config
    assert cfg.timeout_s is not None, "base_config resolves timeout_s"
    label = f"converge {spec.run}: case {cfg.case} [{cfg.short()}]"
    bar = Progress(spec.run, spec.steps) if progress else None
    outcome = TrainOutcome(spec=spec)
    try:
        runner.run(cfg.world_size, train_start, spec, timeout_s=cfg.timeout_s, label=label, case=cfg.case)
        while len(outcome.steps) < spec.steps:
            n = min(chunk, spec.steps - len(outcome.steps))
            outcome.steps += runner.run(cfg.world_size, train_steps, n, timeout_s=cfg.timeout_s + n * 5.0,
                                        label=label, case=cfg.case)[0]
            if bar:
                last = outcome.steps[-1]
                bar.update(len(outcome.steps), (last.run or last.ref).loss)
    except RankFailure as exc:
        if not catch_failures:
            raise
        outcome.failure = exc
    finally:
        try:
            runner.run(cfg.world_size, train_end, None, timeout_s=cfg.timeout_s, label=label, case=cfg.case)
        except Exception:
            pass  # the pool replaces ranks that died; the outcome already says what happened
    return outcome
