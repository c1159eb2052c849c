"""Stage: suites. The convergence commands: `converge` (train reference, baseline and case in
lockstep, record, gate, report), `gate` (re-gate a report directory) and `golden` (store a
golden curve from repeated runs). Each parses its arguments into an options dataclass and calls
one function; the training itself is sp_harness.train.

Runs: the single-device reference, the case's baseline (`Case.baseline`, its tensor-parallel
twin; none when it declares none) and the case under test, all from one initial state on the
batch stream the case declares (`Case.training`; by default its own `make_batch`). Per step and
run the records hold loss, grad norm (replicated parameters counted once), LR, the cross-rank
drift of every replicated parameter, the distance to the reference, step time and tokens/s
(JSONL, full precision); meta.json holds the data's loss floor where the case declares one.

Under `torchrun -m sp_harness.suites.converge` every rank runs the same training in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from sp_harness.config.case import get_case
from sp_harness.config.check_config import CheckConfig
from sp_harness.record.records import StepRecord
from sp_harness.train.driver import TrainOutcome, train
from sp_harness.train.spec import TrainSpec, loss_floor, training_of


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
    seq_len: int = 32
    """Sequence length (tokens per sequence for the GPT cases)."""
    batch: int = 8
    """Sequences per DP replica and step (for cases whose batches have a batch dim)."""
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


def base_config(opts: ConvergeOptions) -> CheckConfig:
    """The case run's config, resolved and validated (ValueError / Unsupported)."""
    case = get_case(opts.case)
    config = case.resolve(CheckConfig(case=opts.case, world_size=opts.world_size, dp=opts.dp, seq_len=opts.seq_len,
                                      batch=opts.batch, dtype=opts.dtype, optimizer=opts.optimizer, lr=opts.lr,
                                      seed=opts.seed, timeout_s=opts.timeout_s))
    case.validate(config)
    return config


def train_runs(opts: ConvergeOptions, runner, *, progress: bool = True) -> dict[str, TrainOutcome]:
    """Train the case (with its reference copy) and its baseline: run name -> outcome. When the
    case's job crashes, 'ref' is a reference-only run (the copy inside the job is lost)."""
    base = base_config(opts)
    common = dict(steps=opts.steps, warmup_steps=opts.warmup_steps, clip_grad_norm=opts.clip_grad_norm,
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
        return [StepRecord(run=name, step=s.step, lr=s.lr, **dataclasses.asdict(s.ref if reference else s.run))
                for s in outcome.steps]

    alone = outcomes.get("ref")
    runs = {"ref": records("ref", alone or outcomes["sp"], True)}
    if "tp" in outcomes:
        runs["tp"] = records("tp", outcomes["tp"], False)
    runs["sp"] = records("sp", outcomes["sp"], False)
    return runs


def converge(opts: ConvergeOptions, runner, out_dir: str | os.PathLike, *, golden: str | None = None,
             progress: bool = True):
    """Train reference, baseline and case in lockstep, write records, gate, write the report.
    Returns (gate result, report.html path, records by run)."""
    from sp_harness.judge.gate import evaluate
    from sp_harness.judge.golden import load_golden
    from sp_harness.record.records import make_meta, write_run_dir
    from sp_harness.report.html import write_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    outcomes = train_runs(opts, runner, progress=progress)
    runs = to_records(outcomes)
    base, case = base_config(opts), get_case(opts.case)
    meta = make_meta(case=opts.case, config=_plain(base), world_size=opts.world_size, dp=opts.dp, tp=base.tp,
                     optimizer=opts.optimizer, dtype=opts.dtype, floor=loss_floor(case, base, opts.data_seed),
                     floor_label=training_of(case).floor_label, runs=list(runs),
                     baseline=opts.baseline_case() or None, steps=opts.steps, wall_s=time.perf_counter() - t0,
                     repro=repro_line("converge", opts, golden=golden))
    golden_doc = load_golden(golden) if golden else None
    result = evaluate(runs, dtype=opts.dtype, golden=golden_doc)
    crashes = {name: o for name, o in outcomes.items() if o.failure is not None}
    if crashes:
        result = _with_crashes(result, crashes)
    html = out / "report.html"
    if not dist.is_initialized() or dist.get_rank() == 0:  # under torchrun every rank gets here
        write_run_dir(out, runs, meta)
        html = write_report(out, runs, meta, result, golden=golden_doc)
    return result, html, runs


def _with_crashes(result, crashes: dict[str, TrainOutcome]):
    from sp_harness.judge.gate import Failure

    extra = tuple(Failure(rule="crash", metric="step", run=run, step=len(o.steps), value=float("nan"), band=0.0,
                          detail=f"{o.failure.describe(with_traces=False)}: {o.failure.summary_line()}")
                  for run, o in sorted(crashes.items()))
    failures = tuple(sorted(extra + tuple(result.failures), key=lambda f: f.sort_key))
    return dataclasses.replace(result, verdict="FAIL", failures=failures)


def _plain(config: CheckConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()}


def format_gate(result, html, repro: str | None = None) -> str:
    lines = [f"gate: {result.verdict}   report: {html}"]
    for reason in result.reasons[:10]:
        lines.append(f"  - {reason}")
    if repro:
        lines.append(f"repro: {repro}")
    return "\n".join(lines)


# ---- CLI -------------------------------------------------------------------------------------


def _add_converge_args(p: argparse.ArgumentParser) -> None:
    d = ConvergeOptions()
    p.add_argument("--case", default=d.case, help=f"case under test (default {d.case})")
    p.add_argument("--baseline", default=d.baseline,
                   help="baseline case (default: the case's declared baseline); 'none' to skip")
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--dp", type=int, default=d.dp)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--dtype", default=d.dtype, choices=["float64", "float32", "bfloat16"])
    p.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "sgd"])
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--clip-grad-norm", type=float, default=d.clip_grad_norm, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data-seed", type=int, default=d.data_seed)
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s")


def options_from_args(args) -> ConvergeOptions:
    for name in ("world_size", "dp", "steps", "seq_len", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world_size % args.dp:
        raise ValueError(f"dp({args.dp}) does not divide world_size({args.world_size})")
    get_case(args.case)
    baseline = "" if args.baseline in ("none", "") else args.baseline
    if baseline:
        get_case(baseline)
    return ConvergeOptions(case=args.case, baseline=baseline, world_size=args.world_size, dp=args.dp, steps=args.steps,
                           seq_len=args.seq_len, batch=args.batch, dtype=args.dtype, optimizer=args.optimizer, lr=args.lr,
                           warmup_steps=args.warmup_steps, clip_grad_norm=args.clip_grad_norm or None, seed=args.seed,
                           data_seed=args.data_seed, timeout_s=args.timeout_s)


def cmd_converge(args) -> int:
    from sp_harness.launch.runner import is_leader as _is_leader
    from sp_harness.launch.runner import runner as _runner

    opts = options_from_args(args)
    result, html, _ = converge(opts, _runner(), args.out, golden=args.golden, progress=_is_leader())
    if _is_leader():
        print(format_gate(result, html, repro_line("converge", opts, golden=args.golden)))
    return 0 if result.passed else 1


def cmd_gate(args) -> int:
    from sp_harness.judge.golden import load_golden
    from sp_harness.report.html import report_from_dir

    golden = load_golden(args.golden) if args.golden else None
    result, html = report_from_dir(args.dir, golden=golden)
    print(format_gate(result, html, shlex.join(["sp-harness", "gate", args.dir]
                                               + (["--golden", args.golden] if args.golden else []))))
    return 0 if result.passed else 1


def cmd_golden(args) -> int:
    from sp_harness.judge.golden import make_golden, save_golden
    from sp_harness.launch.runner import runner as _runner

    opts = options_from_args(args)
    runner = _runner()
    repeats = []
    for i in range(args.repeats):
        _, _, runs = converge(opts, runner, Path(args.work_dir) / f"repeat{i}", progress=True)
        repeats.append(runs[args.run])
    repro = repro_line("golden", opts, repeats=args.repeats, run=args.run, out=args.out, work_dir=args.work_dir)
    doc = make_golden(repeats, meta={"case": opts.case, "run": args.run, "dtype": opts.dtype, "steps": opts.steps,
                                     "world_size": opts.world_size, "dp": opts.dp, "repeats": args.repeats,
                                     "repro": repro})
    path = save_golden(args.out, doc)
    spread = max((max(m["spread"]) if m["spread"] else 0.0) for m in doc["metrics"].values())
    print(f"golden written to {path}: {args.repeats} repeat(s) of run '{args.run}', max spread {spread:.3g}\n"
          f"repro: {repro}")
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("converge", help="lockstep convergence report: reference vs baseline vs case, gated")
    _add_converge_args(p)
    p.add_argument("--out", default="reports/latest", help="report directory (default reports/latest)")
    p.add_argument("--golden", help="golden curve JSON to gate against")
    p.set_defaults(func=cmd_converge)
    p = sub.add_parser("gate", help="re-gate a report directory (optionally against a golden curve)")
    p.add_argument("dir")
    p.add_argument("--golden")
    p.set_defaults(func=cmd_gate)
    p = sub.add_parser("golden", help="make a golden curve file from N repeated runs")
    _add_converge_args(p)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--run", default="sp", help="which run's curve to store (default sp)")
    p.add_argument("--out", required=True, help="golden JSON path, e.g. reports/golden/megatron-gpt-sp.json")
    p.add_argument("--work-dir", default="reports/golden-work")
    p.set_defaults(func=cmd_golden)


def main(argv: list[str] | None = None) -> int:
    """`torchrun --nproc-per-node N -m sp_harness.suites.converge [converge options] --out DIR`."""
    parser = argparse.ArgumentParser(prog="python -m sp_harness.suites.converge")
    _add_converge_args(parser)
    parser.add_argument("--out", default="reports/latest")
    parser.add_argument("--golden")
    args = parser.parse_args(argv)
    return cmd_converge(args)


if __name__ == "__main__":
    sys.exit(main())
