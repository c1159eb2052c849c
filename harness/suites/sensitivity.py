"""Stage: suites. Sensitivity, measured: the smallest error each check sees.

For each dtype and each bug shape of the scaled mutants (cases/megatron/scaled_mutants.py: one
rank's logits, one parameter's grad on one rank, one parameter's optimizer update on one rank,
each off by a relative d; on request a replicated norm weight's grad on every rank), bisect in
log10 space, between d = 1e-16 and d = 1, the smallest d at which the default side-by-side check
(`CheckConfig(case, world_size=2, dtype)`, the default GPT config) gives FAIL, and which check caught it there (the first failure's kind: forward, loss,
grad, param, or replica drift). The targets at the default config (docs/sensitivity.md): float64 d <= 1e-10,
float32 d <= 1e-5, bfloat16 d <= 2e-2.

The bisection assumes detection is monotone in d (a larger error is no harder to see); it checks
the ends first (d = 1 must FAIL, d = 1e-16 must PASS) and reports the bracket [largest d that
passed, smallest d that failed]. `sp-harness sensitivity [--dtype ...] [--shape ...] [--json FILE]`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from sp_harness.config.check_config import CheckConfig, DType

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner

TARGETED_SHAPES = ("forward", "grad", "update")
"""The shapes with targets, and the default run; 'norm-grad' (a replicated norm
weight's grad on every rank) is measured on request, without a target."""
SHAPES = (*TARGETED_SHAPES, "norm-grad")
DTYPES = ("float64", "float32", "bfloat16")
SIZES = ("default", "training")
TARGETS = {"default": {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2},
           "training": {"float64": 1e-10, "float32": 1e-6, "bfloat16": 1e-2}}
"""Largest acceptable minimum detectable d per size and dtype (issues 10 and 23)."""
LO, HI = 1e-16, 1.0
ITERATIONS = 10
WORLD_SIZE = 2
TIMEOUT_S = 300.0
"""Per check: generous, the machine may be shared; a timeout is an error here, never a kill."""


def sized(config: CheckConfig, size: str) -> CheckConfig:
    """`config` at `size`: 'default' leaves the case's defaults, 'training' is the training-like
    size (hidden 256, 256 tokens per sequence, 2 layers, head_dim 64, ffn 4h, vocab 256)."""
    if size == "default":
        return config
    return config.replace(hidden=256, ffn=1024, num_heads=4, seq_len=256, num_layers=2, vocab=256)


@dataclass(kw_only=True)
class Probe:
    d: float
    verdict: str
    caught_by: str = ""
    seconds: float = 0.0


@dataclass(kw_only=True)
class Sensitivity:
    """One dtype x bug shape: the minimum detectable relative error d and what caught it."""

    dtype: str
    shape: str
    case: str
    size: str = "default"
    """'default' (the case's default GPT config) or 'training' (see `sized`)."""
    min_d: float | None
    """Smallest d that FAILed (the bracket's upper end); None if even d = HI passed."""
    max_pass_d: float | None
    """Largest d that PASSed (the bracket's lower end); None if even d = LO failed."""
    caught_by: str = ""
    """The check that caught it at min_d: forward, loss, input_grad, grad, param, replica drift."""
    first_failure: str = ""
    """The check's first failure at min_d, in words."""
    ratio: float | None = None
    """error / allowed of that first failure."""
    target: float | None = None
    target_met: bool | None = None
    error: str = ""
    """A crash or timeout while probing (then the bracket is where it stopped)."""
    checks: int = 0
    seconds: float = 0.0
    probes: list[Probe] = field(default_factory=list)


def caught_by(res) -> str:
    """Which check caught a FAIL first (sp_harness.judge.verdict.CheckResult.first_check)."""
    return res.first_check


def measure(dtype: DType, shape: str, runner: Runner, *, iterations: int = ITERATIONS, lo: float = LO, hi: float = HI,
            progress=None, size: str = "default") -> Sensitivity:
    """Bisect the minimum detectable d for one dtype and bug shape."""
    from sp_harness.cases.megatron.scaled_mutants import CASES, set_scale
    from sp_harness.checks.side_by_side import check
    from sp_harness.judge.verdict import FAIL

    case = CASES[shape].name
    config = sized(CheckConfig(case=case, world_size=WORLD_SIZE, dtype=dtype, timeout_s=TIMEOUT_S), size)
    out = Sensitivity(dtype=dtype, shape=shape, case=case, size=size, min_d=None, max_pass_d=None,
                      target=TARGETS[size].get(dtype) if shape in TARGETED_SHAPES else None)
    t0 = time.perf_counter()
    failed = None

    def probe(d: float):
        for _ in range(2):  # one retry: a crash or hang here is the machine, not the scale
            set_scale(runner, d, WORLD_SIZE)
            res = check(config, runner)
            if not res.error:
                break
        out.checks += 1
        p = Probe(d=d, verdict=res.verdict, caught_by=caught_by(res) if res.verdict == FAIL else "",
                  seconds=res.wall_s)
        out.probes.append(p)
        if progress:
            progress(f"  {size:<8} {dtype:<9} {shape:<8} d={d:<10.4g} {res.verdict:<5} {p.caught_by:<14} {res.wall_s:.1f}s")
        if res.error:
            out.error = f"d={d!r}: {res.reason}"
        return res

    try:
        res = probe(hi)
        if res.verdict != FAIL or res.error:
            return out
        out.min_d, failed = hi, res
        res = probe(lo)
        if res.error:
            return out
        if res.verdict == FAIL:
            out.min_d, failed = lo, res
            return out
        out.max_pass_d = lo
        a, b = math.log10(lo), math.log10(hi)
        for _ in range(iterations):
            m = (a + b) / 2
            res = probe(10.0 ** m)
            if res.error:
                return out
            if res.verdict == FAIL:
                b, failed = m, res
                out.min_d = 10.0 ** m
            else:
                a = m
                out.max_pass_d = 10.0 ** m
        return out
    finally:
        set_scale(runner, None, WORLD_SIZE)
        if failed is not None:
            out.caught_by = caught_by(failed)
            out.first_failure = failed.first_failure
            out.ratio = failed.failures[0].ratio if failed.failures and out.caught_by != "replica drift" else None
        if out.target is not None:
            out.target_met = out.min_d is not None and out.min_d <= out.target and not out.error
        out.seconds = time.perf_counter() - t0


def format_table(rows: list[Sensitivity]) -> str:
    lines = [f"{'size':<8} {'dtype':<9} {'shape':<8} {'min detectable d':>17} {'(largest pass)':>15}  {'caught by':<14} "
             f"{'target':>7}  {'met':<4} {'checks':>6} {'time':>7}"]
    for r in rows:
        min_d = "not caught" if r.min_d is None else f"{r.min_d:.3g}"
        passed = "-" if r.max_pass_d is None else f"{r.max_pass_d:.3g}"
        target = "" if r.target is None else f"{r.target:g}"
        met = "" if r.target_met is None else ("yes" if r.target_met else "NO")
        lines.append(f"{r.size:<8} {r.dtype:<9} {r.shape:<8} {min_d:>17} {passed:>15}  {r.caught_by:<14} {target:>7}  {met:<4} "
                     f"{r.checks:>6} {r.seconds:>6.1f}s" + (f"  ERROR {r.error[:80]}" if r.error else ""))
    keys = list(dict.fromkeys((r.size, r.dtype) for r in rows))
    shapes = list(dict.fromkeys(r.shape for r in rows))
    cell = {(r.size, r.dtype, r.shape): r for r in rows}
    lines.append("")
    lines.append(f"{'min d (caught by)':<27}" + "".join(f"{s:>26}" for s in shapes) + f"{'target':>10}")
    for size, dt in keys:
        parts = []
        for s in shapes:
            c = cell.get((size, dt, s))
            parts.append("" if c is None else ("not caught" if c.min_d is None else f"{c.min_d:.2g} ({c.caught_by})"))
        mets = [cell[(size, dt, s)].target_met for s in shapes
                if (size, dt, s) in cell and cell[(size, dt, s)].target is not None]
        verdict = "" if not mets else ("met" if all(mets) else "NOT met")
        goal = TARGETS[size].get(dt, float("nan"))
        lines.append(f"{size + ' ' + dt:<27}" + "".join(f"{p:>26}" for p in parts) + f"{goal:>10g} {verdict}")
    return "\n".join(lines)


def cmd_sensitivity(args) -> int:
    from sp_harness.launch.runner import runner as _runner

    if not LO <= args.lo < HI:
        raise ValueError(f"--lo {args.lo!r} is outside [{LO:g}, {HI:g})")
    if args.iterations < 1:
        raise ValueError(f"--iterations {args.iterations} must be at least 1")
    runner = _runner()
    t0 = time.perf_counter()
    rows = []
    for size in args.size:
        for dtype in args.dtype:
            for shape in args.shape:
                rows.append(measure(dtype, shape, runner, iterations=args.iterations, size=size, lo=args.lo,
                                    progress=lambda line: print(line, flush=True)))
    print(format_table(rows))
    print(f"total {time.perf_counter() - t0:.1f}s, {sum(r.checks for r in rows)} checks")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0 if all(r.target_met is not False for r in rows) else 1


def add_subcommands(sub) -> None:
    p = sub.add_parser("sensitivity", help="bisect the smallest relative error each check catches, per dtype; "
                                           "exit 1 if a target is missed")
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES), help="dtypes to bisect (default: all)")
    p.add_argument("--shape", nargs="+", choices=SHAPES, default=list(TARGETED_SHAPES),
                   help="bug shapes (scaled mutants) to measure (default: the three with targets; 'norm-grad' "
                        "has none)")
    p.add_argument("--iterations", type=int, default=ITERATIONS, help=f"bisection steps (default {ITERATIONS})")
    p.add_argument("--size", nargs="+", choices=SIZES, default=["default"],
                   help="model sizes: the case's default config, and/or 'training' (hidden 256, seq 256, 2 layers) "
                        "(default: default)")
    p.add_argument("--lo", type=float, default=LO, help=f"the bracket's lower end (default {LO:g}); a higher one "
                   "spends the bisection where a low-precision dtype's answer lies")
    p.add_argument("--json", metavar="FILE", help="write the records (full-precision numbers) as JSON")
    p.set_defaults(func=cmd_sensitivity)
