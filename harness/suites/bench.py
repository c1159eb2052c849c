"""Stage: suites. `sp-harness bench`: what the harness costs, what SP saves, in one table.

One run measures, on this machine:
  (a) examples/s through the warm pool vs spawn-per-example (a fresh RankPool per example: start
      + run + close, what MultiProcessTestCase / mp.spawn-per-test pays), world sizes 2 and 4,
      for the seed case and the subject (SUBJECT); targets at 4 ranks >= 200x (seed), >= 50x;
  (b) harness overhead at the cases' small default sizes: time per verified example (`check`)
      over the bare compute of the same models (`bench_bare.bare_rank`: build reference + sharded, forward /
      backward / grad sync / optimizer step on both, nothing captured or compared);
  (c) cost per example of the subject vs world size 1..8 and vs sequence length;
  (d) activation memory of one layer (sp_harness.checks.activation_memory) for no parallelism, TP and TP+SP at every
      world size, against the paper's and the adjusted formulas; communication TP vs TP+SP
      (sp_harness.compare.comm_volume); the memory mutants' verdicts beside them;
  (e) wall time of the default convergence job (`ConvergeOptions()`, 2 ranks); target < 3 min;
  (f)-(i) at realistic sizes (sp_harness.suites.bench_realistic): cost per verified example
      against bare compute for every built-in case at 2 and 4 ranks (target <= 1.5x; the subject
      at hidden 1024, seq 2048, 2 ranks: < 3x), peak resident memory per rank against bare
      (<= 2x), the test suite's wall time under `pytest -n auto` (< 5 min), and where one
      verified example's time goes, per rank and stage (sp_harness.suites.bench_profile);
  (j) a user's test file of N examples through the pytest plugin against N `sp-harness check`
      commands (sp_harness.suites.bench_plugin);
  (k) the training-step check against a side-by-side check of the same config and K
      (sp_harness.suites.bench_train);
  then every target with its figure, MET or MISSED and by what factor (`targets`).

An "example" is one `check(config)`: one side-by-side verification (default 2 optimizer steps).
Times are medians of the repetitions; spawn-per-example is expensive, so it is sampled once per
cell (`--spawn-reps`). The machine's load average is printed: other work on the cores skews all
of it. `--profile` runs (i) alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import all_cases, get_case
from sp_harness.suites.bench_bare import timed_bare
from sp_harness.suites.bench_plugin import format_plugin, plugin_row
from sp_harness.suites.bench_targets import SUBJECT, format_targets, targets, worst_memory_ratio
from sp_harness.suites.bench_train import format_train, train_row

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner

P = TypeVar("P")
R = TypeVar("R")

# (c) and the memory table need tp <= num_heads up to 8 ranks: 8 heads
SCALE: dict[str, Any] = dict(hidden=32, num_heads=8, ffn=64, seq_len=24)
MEMORY: dict[str, Any] = dict(hidden=64, num_heads=8, ffn=256, seq_len=24, dtype="float32")


# ------------------------------------------------------------------ driver helpers


class _OnePool:
    """A single RankPool behind the PoolManager.run interface (for spawn-per-example)."""

    def __init__(self, pool):
        self.pool = pool

    def run(self, world_size: int, fn_ref: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            case: str | None = None) -> list[R]:
        return self.pool.run(fn_ref, payload, timeout_s=timeout_s, label=label)

    def close(self) -> None:
        """Nothing: the pool's owner closes it (`spawn_example`)."""


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _timed_checks(config: CheckConfig, runner: Runner, reps: int) -> tuple[list[float], str]:
    from sp_harness.checks.side_by_side import check

    times, verdict = [], ""
    for _ in range(reps):
        t0 = time.perf_counter()
        res = check(config, runner)
        times.append(time.perf_counter() - t0)
        verdict = res.verdict
    return times, verdict


def spawn_example(config: CheckConfig) -> dict:
    """One example the spawn-per-test way: fresh ranks, rendezvous, run, tear down."""
    from sp_harness.checks.side_by_side import check
    from sp_harness.launch.pool import RankPool

    t0 = time.perf_counter()
    pool = RankPool(config.world_size)
    pool.start()
    t_start = time.perf_counter() - t0
    try:
        res = check(config, _OnePool(pool))
    finally:
        pool.close()
    return {"total_s": time.perf_counter() - t0, "start_s": t_start, "verdict": res.verdict}


# ------------------------------------------------------------------ the benchmark


def speed_cases() -> tuple[str, ...]:
    """The throughput and overhead cells: the seed case(s) and the subject."""
    seeds = sorted(n for n, c in all_cases().items() if "seed" in c.tags and "mutant" not in c.tags)
    return (*seeds, SUBJECT)


def memory_mutants() -> tuple[str, ...]:
    """Mutants of the subject that only the memory and communication figures catch."""
    return tuple(sorted(n for n, c in all_cases().items() if c.twin == SUBJECT and "memory" in c.tags))


def _spawn_cells(world_sizes: tuple[int, ...], reps: int, log) -> dict[str, dict]:
    """(a) spawn-per-example: fresh pools, before any warm pool exists."""
    spawn: dict[str, dict] = {}
    for case in speed_cases():
        for ws in world_sizes:
            samples = [spawn_example(CheckConfig(case=case, world_size=ws)) for _ in range(reps)]
            spawn[f"{case}@{ws}"] = {"s": _median([s["total_s"] for s in samples]),
                                     "start_s": _median([s["start_s"] for s in samples]),
                                     "verdict": samples[-1]["verdict"], "n": len(samples)}
            log(f"  spawn-per-example {case} ws={ws}: {spawn[f'{case}@{ws}']['s']:.2f}s")
    return spawn


def _warm_median(config: CheckConfig, manager, reps: int) -> tuple[float, str]:
    """Median of `reps` checks after one untimed one (a fresh size's first job: imports, groups)."""
    from sp_harness.checks.side_by_side import check

    check(config, manager)
    times, verdict = _timed_checks(config, manager, reps)
    return _median(times), verdict


def _speed_cells(manager, ws: int, reps: int, out: dict) -> None:
    """(a) warm s/example and (b) overhead over bare compute, every speed case at `ws`."""
    for case in speed_cases():
        cfg = CheckConfig(case=case, world_size=ws)
        check_s, verdict = _warm_median(cfg, manager, reps)
        bare = timed_bare(cfg, manager, reps)
        out["warm"][f"{case}@{ws}"] = {"s": check_s, "verdict": verdict}
        out["overhead"][f"{case}@{ws}"] = {"check_s": check_s, "bare_s": _median(bare)}


def _memory_rows(manager, ws: int, mutants: tuple[str, ...]) -> list[dict]:
    """(d) one layer's activation bytes at `ws` (and, at ws 1, without parallelism)."""
    from sp_harness.checks.activation_memory import activation_gate, activation_report, adjusted_bytes, paper_bytes
    from sp_harness.checks.activation_memory_rank import measure_reference_layer, memory_config

    mcfg = memory_config(CheckConfig(case=SUBJECT, world_size=ws, **MEMORY))
    assert (mcfg.seq_len is not None and mcfg.batch is not None and mcfg.hidden is not None
            and mcfg.num_heads is not None), "memory_config resolves the shape"
    dims = dict(s=mcfg.seq_len, b=mcfg.batch, h=mcfg.hidden, a=mcfg.num_heads)
    rows = []
    if ws == 1:
        ref = measure_reference_layer(mcfg)
        adj = adjusted_bytes("none", mcfg)
        rows.append({"t": 1, "mode": "none", "paper": paper_bytes("none", **dims), "adjusted": adj,
                     "measured": ref.activation_bytes, "ratio": ref.activation_bytes / adj})
    for case in (SUBJECT, *mutants):
        rep = activation_report(mcfg.replace(case=case), manager, tp_case=get_case(SUBJECT).baseline)
        ok, msg = activation_gate(rep)
        row = rep.rows[0]
        rows.append({
            "t": ws, "mode": "sp" if case == SUBJECT else "mutant", "case": case,
            "paper_tp": paper_bytes("tp", t=ws, **dims), "paper_sp": paper_bytes("sp", t=ws, **dims),
            "tp_adjusted": row.tp_adjusted, "tp_measured": row.tp_bytes, "tp_ratio": row.tp_vs_adjusted,
            "sp_adjusted": row.sp_adjusted, "sp_measured": row.sp_bytes, "sp_ratio": row.sp_vs_adjusted,
            "sp_tp": row.sp_tp_ratio, "sp_tp_adjusted": row.sp_tp_expected,
            "sp_tp_paper": rep.paper_sp_tp_ratio, "norm_ratio": row.norm_ratio,
            "norm_expected": row.norm_ratio_expected, "gate_ok": ok, "gate": msg,
            "worst_ratio_all_ranks": max(max(abs(_adjusted(r.sp_vs_adjusted) - 1), abs(_adjusted(r.tp_vs_adjusted) - 1))
                                         for r in rep.rows),
        })
    return rows


def _adjusted(ratio: float | None) -> float:
    assert ratio is not None, "the memory config's model is a LayerNorm one: the adjusted formula exists"
    return ratio


def _comm_rows(manager, ws: int) -> list[dict]:
    """(d) communication of the subject and its memory mutants against their TP baseline."""
    from sp_harness.checks.side_by_side import check
    from sp_harness.compare.comm_volume import paper_check

    base = CheckConfig(case=get_case(SUBJECT).baseline, world_size=ws)
    tp_res = check(base, manager)
    rows = []
    for case in (SUBJECT, *memory_mutants()):
        res = check(base.replace(case=case), manager)
        fig = paper_check(tp_res.comm, res.comm, tp=ws)
        rows.append({"case": case, "world_size": ws, "verdict": res.verdict, "ok": fig.matches,
                     "message": fig.describe(), "tp_ring_bytes": fig.tp_ring_bytes, "sp_ring_bytes": fig.sp_ring_bytes})
    return rows


def _world_size_cells(manager, ws: int, *, speed: bool, seq_lens: tuple[int, ...], reps: int, out: dict, log) -> None:
    """Every warm-pool figure at one world size, into `out`."""
    t0 = time.perf_counter()
    manager.get(ws).start()
    pool_start = time.perf_counter() - t0
    s, verdict = _warm_median(CheckConfig(case=SUBJECT, world_size=ws, **SCALE), manager, reps)
    out["scaling"].append({"world_size": ws, "s": s, "verdict": verdict, "pool_start_s": pool_start})
    log(f"  ws={ws}: pool start {pool_start:.2f}s, {SUBJECT} example {s:.3f}s")
    if speed:
        _speed_cells(manager, ws, reps, out)
    if ws == 2:
        for n in seq_lens:
            s, verdict = _warm_median(CheckConfig(case=SUBJECT, world_size=ws, **dict(SCALE, seq_len=n)), manager, reps)
            out["seq"].append({"seq_len": n, "world_size": ws, "s": s, "verdict": verdict})
    out["memory"].extend(_memory_rows(manager, ws, memory_mutants() if speed else ()))
    if speed:
        out["comm"].extend(_comm_rows(manager, ws))


def _converge_cell(steps: int | None) -> dict:
    """(e) the default convergence job, as `sp-harness converge` runs it (fresh pool included)."""
    from sp_harness.launch.manager import PoolManager
    from sp_harness.suites.converge import ConvergeOptions, converge

    opts = ConvergeOptions() if steps is None else ConvergeOptions(steps=steps)
    manager = PoolManager()
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="sp-harness-bench-") as tmp:
            result, _, _ = converge(opts, manager, tmp, progress=False)
    finally:
        manager.close()
    return {"s": time.perf_counter() - t0, "steps": opts.steps, "world_size": opts.world_size,
            "passed": bool(result.passed)}


def run_bench(*, quick: bool = False, spawn_reps: int = 1, reps: int | None = None, converge_steps: int | None = None,
              log=print) -> dict:
    from sp_harness.launch.manager import PoolManager

    t_bench = time.perf_counter()
    reps = reps or (2 if quick else 3)
    speed_ws = (2,) if quick else (2, 4)
    out: dict[str, Any] = {"quick": quick, "load_before": os.getloadavg(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "subject": SUBJECT, "warm": {}, "overhead": {}, "scaling": [],
                           "seq": [], "memory": [], "comm": []}
    spawn = _spawn_cells(speed_ws, spawn_reps, log)
    manager = PoolManager(max_pools=2)
    try:
        for ws in (1, 2) if quick else tuple(range(1, 9)):
            _world_size_cells(manager, ws, speed=ws in speed_ws, seq_lens=(8, 32) if quick else (8, 32, 128),
                              reps=reps, out=out, log=log)
    finally:
        manager.close()
    out["converge"] = _converge_cell(converge_steps)
    out["plugin"] = plugin_row(n=3 if quick else 8)
    manager = PoolManager(max_pools=1)
    try:
        out["train"] = train_row(manager, reps=1 if quick else 3)
    finally:
        manager.close()
    log("  " + format_train(out["train"]))
    log(f"  plugin {out['plugin']['plugin_s']:.2f}s vs CLI {out['plugin']['cli_s']:.2f}s")
    for key, sp in spawn.items():
        w = out["warm"].get(key)
        if w:
            sp["warm_s"] = w["s"]
            sp["speedup"] = sp["s"] / w["s"]
    out.update(spawn=spawn, load_after=os.getloadavg(), bench_s=time.perf_counter() - t_bench)
    return out


# ------------------------------------------------------------------ the table


def _fmt_b(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _format_speed(r: dict) -> list[str]:
    L = ["(a) throughput: warm pool vs spawn-per-example (fresh ranks: start + run + close)",
         f"  {'case':<18} {'ws':>3} {'warm s/ex':>10} {'warm ex/s':>10} {'spawn s/ex':>11} {'(start)':>8} {'ex/s':>7} "
         f"{'speedup':>8}  verdict"]
    for key, sp in r["spawn"].items():
        case, ws = key.split("@")
        if "warm_s" in sp:
            L.append(f"  {case:<18} {ws:>3} {sp['warm_s']:>10.3f} {1 / sp['warm_s']:>10.2f} {sp['s']:>11.2f} "
                     f"{sp['start_s']:>8.2f} {1 / sp['s']:>7.3f} {sp['speedup']:>7.1f}x  {sp['verdict']}")
    L += ["", "(b) harness overhead: verified example (check) / bare compute (bare_rank: ref + sharded fwd/bwd/step)",
          f"  {'case':<18} {'ws':>3} {'check s':>9} {'bare s':>9} {'overhead':>9}"]
    for key, o in r["overhead"].items():
        case, ws = key.split("@")
        L.append(f"  {case:<18} {ws:>3} {o['check_s']:>9.3f} {o['bare_s']:>9.3f} {o['check_s'] / o['bare_s']:>8.2f}x")
    sc = SCALE
    L += ["", f"(c) {r.get('subject', SUBJECT)} cost per example (hidden {sc['hidden']}, heads {sc['num_heads']}, "
              f"ffn {sc['ffn']}, batch 2, 2 layers, float64, 2 steps)",
          f"  {'ws':>3} {'seq':>5} {'s/example':>10} {'ex/s':>7} {'pool start s':>13}  verdict"]
    for row in r["scaling"]:
        L.append(f"  {row['world_size']:>3} {sc['seq_len']:>5} {row['s']:>10.3f} {1 / row['s']:>7.2f} "
                 f"{row['pool_start_s']:>13.2f}  {row['verdict']}")
    for row in r["seq"]:
        L.append(f"  {row['world_size']:>3} {row['seq_len']:>5} {row['s']:>10.3f} {1 / row['s']:>7.2f} {'':>13}  "
                 f"{row['verdict']}")
    return L


def _format_memory(r: dict) -> list[str]:
    m = MEMORY
    L = [f"(d) activation bytes saved for backward by ONE layer, rank 0 (s={m['seq_len']} b=2 h={m['hidden']} "
         f"a={m['num_heads']} ffn={m['ffn']}=4h {m['dtype']}); paper = Korthikanti et al. 16-bit with dropout",
         f"  {'t':>2} {'mode':<7} {'paper TP':>9} {'adj TP':>9} {'meas TP':>9} {'m/a':>6} {'paper SP':>9} "
         f"{'adj SP':>9} {'meas SP':>9} {'m/a':>6} {'SP/TP':>6} {'adj':>6} {'paper':>6} {'norm':>6} {'exp':>6}  gate"]
    for row in r["memory"]:
        if row["mode"] == "none":
            L.append(f"  {1:>2} {'none':<7} {_fmt_b(row['paper']):>9} {_fmt_b(row['adjusted']):>9} "
                     f"{_fmt_b(row['measured']):>9} {row['ratio']:>6.3f}   (no parallelism: reference.gpt.Block in-process)")
            continue
        L.append(f"  {row['t']:>2} {row['mode']:<7} {_fmt_b(row['paper_tp']):>9} {_fmt_b(row['tp_adjusted']):>9} "
                 f"{_fmt_b(row['tp_measured']):>9} {row['tp_ratio']:>6.3f} {_fmt_b(row['paper_sp']):>9} "
                 f"{_fmt_b(row['sp_adjusted']):>9} {_fmt_b(row['sp_measured']):>9} {row['sp_ratio']:>6.3f} "
                 f"{row['sp_tp']:>6.3f} {row['sp_tp_adjusted']:>6.3f} {row['sp_tp_paper']:>6.3f} "
                 f"{row['norm_ratio']:>6.3f} {row['norm_expected']:>6.3f}  {'PASS' if row['gate_ok'] else 'FAIL'}")
    L.append(f"  worst |measured/adjusted - 1| over all ranks and world sizes (correct cases): "
             f"{worst_memory_ratio(r):.2%} (target <= 5%)")
    L += ["", "    communication per step per rank, TP vs TP+SP (forward + backward activation collectives, ring bytes)"]
    for row in r["comm"]:
        L.append(f"  ws={row['world_size']} {row['case']:<30} numerics {row['verdict']:<5} TP {row['tp_ring_bytes']:>9.0f} "
                 f"SP {row['sp_ring_bytes']:>9.0f}  {'PASS' if row['ok'] else 'FAIL'}")
    c = r["converge"]
    L += ["", f"(e) default convergence job (ConvergeOptions(): {c['steps']} steps, {c['world_size']} ranks, ref + TP + SP): "
              f"{c['s']:.1f}s, gate {'PASS' if c['passed'] else 'FAIL'}"]
    return L


def format_bench(r: dict) -> str:
    head = (f"sp-harness bench{' --quick' if r['quick'] else ''}: torch {r['torch']}, {r['cpus']} CPUs, "
            f"load avg before {r['load_before'][0]:.2f}, after {r['load_after'][0]:.2f}, total {r['bench_s']:.0f}s")
    return "\n".join([head, "", *_format_speed(r), "", *_format_memory(r), "", format_plugin(r["plugin"]), "",
                      format_train(r["train"])])


def cmd_bench(args) -> int:
    from sp_harness.suites.bench_profile import format_profile
    from sp_harness.suites.bench_realistic import format_realistic, profile_subject, run_realistic

    if args.profile:
        result: dict[str, Any] = {"profile": profile_subject(quick=args.quick)}
        print(format_profile(result["profile"]), flush=True)
    else:
        result = run_bench(quick=args.quick, spawn_reps=args.spawn_reps, reps=args.reps,
                           converge_steps=10 if args.quick else None)
        print(format_bench(result), flush=True)
        if not args.no_realistic:
            suite = args.suite or not (args.quick or args.no_suite)  # quick runs are the suite's own tests
            result["realistic"] = run_realistic(quick=args.quick, suite=suite)
            print(format_realistic(result["realistic"]), flush=True)
        result["targets"] = [dataclasses.asdict(t) | {"met": t.met, "factor": t.factor} for t in targets(result)]
        print(format_targets(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("bench", help="throughput vs spawn-per-example, harness overhead, scaling, activation memory, "
                                     "communication, convergence wall time: one table")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--quick", action="store_true", help="a small, fast subset (ws 1-2, short convergence): for tests")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per warm cell (default 3, quick 2)")
    p.add_argument("--spawn-reps", type=int, default=1, help="spawn-per-example samples per cell (default 1)")
    p.add_argument("--no-realistic", action="store_true", help="skip the realistic-size cost and memory tables")
    p.add_argument("--suite", action="store_true", help="time the whole test suite (pytest -n auto) even with --quick")
    p.add_argument("--no-suite", action="store_true", help="skip timing the whole test suite (pytest -n auto)")
    p.add_argument("--profile", action="store_true",
                   help=f"only (i): where one verified {SUBJECT} example's time goes, per rank and stage")
    p.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sp_harness.suites.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(["bench", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
