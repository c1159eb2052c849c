"""Stage: train. Converge's engine: the case under test (with the reference copy trained
alongside it), its baseline and, when the case's job crashes, a reference-only run, trained in
lockstep from one initial state on the case's batch stream, turned into step records and gated
(sp_harness.judge.gate). `opts` is the run's options (`ConvergeOptions`): the case, world size,
steps, schedule, dtype and seeds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sp_harness.config.check_config import CheckConfig
from sp_harness.config.converge_options import ConvergeOptions
from sp_harness.config.registry import get_case
from sp_harness.judge.gate import GateResult, evaluate
from sp_harness.record.records import StepRecord
from sp_harness.train.driver import TrainOutcome, train
from sp_harness.train.rank import Measured, StepResult
from sp_harness.train.spec import TrainSpec

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner


def base_config(opts: ConvergeOptions) -> CheckConfig:
    """The case run's config, resolved and validated (ValueError / Unsupported)."""
    case = get_case(opts.case)
    training = case.training
    seq_len = opts.seq_len if opts.seq_len is not None else training.seq_len if training else None
    batch = opts.batch if opts.batch is not None else training.batch if training else None
    # steps: the run's own count, so what meta.json records is what ran
    config = case.resolve(CheckConfig(**{**opts.run_values(), "seq_len": seq_len, "batch": batch}))
    case.validate(config)
    return config


def config_sources(case, opts: ConvergeOptions) -> dict[str, str]:
    """Where each field of the run's config came from: 'run' (the options), 'training' (the
    case's convergence defaults), 'case' (its check defaults), or 'engine default' (filled by the
    engine: a case that does not read that field ignores it, so it says nothing of the model)."""
    from sp_harness.config.check_config import ENGINE_DEFAULTS

    given = set(opts.run_values()) - {"seq_len", "batch"}
    given |= {k for k in ("seq_len", "batch") if getattr(opts, k) is not None}
    training = {k for k in ("seq_len", "batch") if case.training is not None and getattr(case.training, k) is not None}
    out = {}
    for f in dataclasses.fields(CheckConfig):
        out[f.name] = ("run" if f.name in given else "training" if f.name in training else
                       "case" if f.name in case.defaults else "engine default" if f.name in ENGINE_DEFAULTS else "unset")
    return out


def train_runs(opts: ConvergeOptions, runner: Runner, *, progress: bool = True) -> dict[str, TrainOutcome]:
    """Train the case (with its reference copy) and its baseline: run name -> outcome. When the
    case's job crashes, 'ref' is a reference-only run (the copy inside the job is lost)."""
    base = base_config(opts)
    common: dict[str, Any] = dict(steps=opts.steps, warmup_steps=opts.warmup_steps, clip_grad_norm=opts.clip_grad_norm,
                  data_case=opts.case, data_seed=opts.data_seed)
    runs = {"sp": train(TrainSpec(run="sp", config=base, **common), runner, progress=progress, catch_failures=True)}
    if runs["sp"].failure is not None:
        spec = TrainSpec(run="ref", config=base.replace(world_size=opts.dp), reference_only=True, **common)
        runs["ref"] = train(spec, runner, progress=progress, catch_failures=True)
    baseline = opts.baseline_case()
    if baseline:
        runs["tp"] = train(TrainSpec(run="tp", config=base.replace(case=baseline), **common), runner,
                           progress=progress, catch_failures=True)
    return runs


def to_records(outcomes: dict[str, TrainOutcome]) -> dict[str, list[StepRecord]]:
    """Step records in report order (ref, tp, sp): the reference from the case run's copy unless
    it was trained alone."""
    def records(name: str, outcome: TrainOutcome, reference: bool) -> list[StepRecord]:
        return [StepRecord(run=name, step=s.step, lr=s.lr, **dataclasses.asdict(_measured(s, reference)))
                for s in outcome.steps]

    alone = outcomes.get("ref")
    runs = {"ref": records("ref", alone or outcomes["sp"], True)}
    if "tp" in outcomes:
        runs["tp"] = records("tp", outcomes["tp"], False)
    runs["sp"] = records("sp", outcomes["sp"], False)
    return runs


def _measured(s: StepResult, reference: bool) -> Measured:
    m = s.ref if reference else s.run
    assert m is not None, "a sharded run's steps measure the sharded model"
    return m


def _with_crashes(result, crashes: dict[str, TrainOutcome]):
    from sp_harness.judge.gate import Failure

    extra = []
    for run, o in sorted(crashes.items()):
        assert o.failure is not None, "crashes holds the outcomes a failure ended"
        extra.append(Failure(rule="crash", metric="step", run=run, step=len(o.steps), value=float("nan"), band=0.0,
                             detail=o.failure.one_line()))
    failures = tuple(sorted(tuple(extra) + tuple(result.failures), key=lambda f: f.sort_key))
    return dataclasses.replace(result, verdict="FAIL", failures=failures)


def plain_config(config: CheckConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()}


@dataclass(kw_only=True)
class LockstepRun:
    """One lockstep run, gated."""

    result: GateResult
    runs: dict[str, list[StepRecord]]
    """Step records by run name ('ref', 'tp', 'sp')."""
    outcomes: dict[str, TrainOutcome]
    wall_s: float


def run_lockstep(opts: ConvergeOptions, runner: Runner, *, golden_doc: dict | None = None,
                 progress: bool = True) -> LockstepRun:
    """Train reference, baseline and case in lockstep and gate the records (a crash is a FAIL)."""
    t0 = time.perf_counter()
    outcomes = train_runs(opts, runner, progress=progress)
    runs = to_records(outcomes)
    result = evaluate(runs, dtype=opts.dtype, golden=golden_doc, num_steps=opts.steps)
    crashes = {name: o for name, o in outcomes.items() if o.failure is not None}
    if crashes:
        result = _with_crashes(result, crashes)
    return LockstepRun(result=result, runs=runs, outcomes=outcomes, wall_s=time.perf_counter() - t0)
