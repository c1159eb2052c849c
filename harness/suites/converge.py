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

Under `torchrun -m sp_harness.cli converge` every rank runs the same training in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from sp_harness.config.converge_options import ConvergeOptions, repro_line
from sp_harness.config.flags import add_flags, from_args
from sp_harness.config.registry import get_case
from sp_harness.train.lockstep_runs import base_config, config_sources, plain_config, run_lockstep
from sp_harness.train.spec import loss_floor, training_of

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner


def converge(opts: ConvergeOptions, runner: Runner, out_dir: str | os.PathLike, *, golden: str | None = None,
             progress: bool = True):
    """Train reference, baseline and case in lockstep, write records, gate, write the report.
    Returns (gate result, report.html path, records by run)."""
    from sp_harness.judge.golden import load_golden
    from sp_harness.launch.runner import is_leader
    from sp_harness.record.environment import run_environment
    from sp_harness.record.records import make_meta, write_run_dir
    from sp_harness.report.html import write_report

    out = Path(out_dir)
    writer = is_leader()  # under torchrun every rank gets here
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    golden_doc = load_golden(golden) if golden else None
    run = run_lockstep(opts, runner, golden_doc=golden_doc, progress=progress)
    base, case = base_config(opts), get_case(opts.case)
    meta = make_meta(case=opts.case, config=plain_config(base), world_size=opts.world_size, dp=opts.dp, tp=base.tp,
                     optimizer=opts.optimizer, dtype=opts.dtype, floor=loss_floor(case, base, opts.data_seed),
                     floor_label=training_of(case).floor_label, runs=list(run.runs),
                     baseline=opts.baseline_case() or None, steps=opts.steps, wall_s=run.wall_s,
                     repro=repro_line("converge", opts, golden=golden), options=dataclasses.asdict(opts),
                     config_sources=config_sources(case, opts), environment=run_environment())
    html = out / "report.html"
    if writer:
        write_run_dir(out, run.runs, meta)
        html = write_report(out, run.runs, meta, run.result, golden=golden_doc)
    return run.result, html, run.runs


def format_gate(result, html, repro: str | None = None) -> str:
    lines = [f"gate: {result.verdict}   report: {html}"] + [f"  note: {n}" for n in result.notes]
    for reason in result.reasons[:10]:
        lines.append(f"  - {reason}")
    if repro:
        lines.append(f"repro: {repro}")
    return "\n".join(lines)


# ---- CLI -------------------------------------------------------------------------------------


def _add_converge_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, ConvergeOptions)  # one flag per field, generated from its declarations


def options_from_args(args) -> ConvergeOptions:
    opts = from_args(ConvergeOptions, args, baseline="" if args.baseline in ("none", "") else args.baseline)
    get_case(opts.case)
    if opts.baseline:
        get_case(opts.baseline)
    return opts


def validate_options(opts: ConvergeOptions, out: str) -> None:
    """Usage errors (ValueError, exit 2) before any rank starts: the case, its config, the world
    size, the baseline, the output folder."""
    from sp_harness.config.case import Unsupported
    from sp_harness.launch.runner import check_world_size
    from sp_harness.record.outdir import check_out

    check_world_size(opts.world_size)
    try:
        base_config(opts)
        if opts.baseline_case():
            get_case(opts.baseline_case())
    except Unsupported as exc:
        raise ValueError(f"{opts.case} cannot train this config: {exc}") from None
    check_out(out)  # after the case: a wrong --case is named first


def cmd_converge(args) -> int:
    from sp_harness.launch.runner import is_leader as _is_leader
    from sp_harness.launch.runner import runner as _runner
    from sp_harness.record.outdir import open_run_dir

    opts = options_from_args(args)
    validate_options(opts, args.out)
    # a run of its own, published to --out when complete: concurrent runs never mix
    run_dir = open_run_dir(args.out) if _is_leader() else None
    with run_dir or contextlib.nullcontext():  # an interrupted run's directory is removed
        result, html, _ = converge(opts, _runner(), run_dir.path if run_dir else args.out, golden=args.golden,
                                   progress=_is_leader())
        if run_dir is not None:
            html = run_dir.publish() / html.name
    if run_dir is not None:
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
    p.add_argument("dir", help="a report directory written by converge or nightly")
    p.add_argument("--golden", help="golden curve JSON to gate against")
    p.set_defaults(func=cmd_gate)
    p = sub.add_parser("golden", help="make a golden curve file from N repeated runs")
    _add_converge_args(p)
    p.add_argument("--repeats", type=int, default=2, help="runs whose spread sets the band (default 2)")
    p.add_argument("--run", default="sp", help="which run's curve to store (default sp)")
    p.add_argument("--out", required=True, help="golden JSON path, e.g. reports/golden/megatron-gpt-sp.json")
    p.add_argument("--work-dir", default="reports/golden-work", help="where the repeated runs go (default reports/golden-work)")
    p.set_defaults(func=cmd_golden)

