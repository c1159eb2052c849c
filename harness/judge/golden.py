"""Stage: judge. Stored loss / grad-norm curves a new run must stay close to.

The lockstep rule compares runs of one job against each other; a golden compares a run against
what the same configuration produced before (another commit, another torch, another machine).
The format follows Megatron-LM's functional-test goldens, plus a per-step spread:

    {"metrics": {"loss": {"start_step": 0, "end_step": 99, "step_interval": 1,
                          "values": [...], "spread": [...]}, ...},
     "meta": {"num_repeats": 3, "dtype": "float32", ...}}

`values` is the mean over N repeated runs at steps start_step, start_step + step_interval, ...,
end_step, and `spread` the max - min across the repeats at each of those steps. The band is

    band(step) = max(golden_spread_factor * spread(step), GateBands.tight(dtype, value, step))

so a deterministic CPU golden (spread exactly 0) is held to the same dtype-derived band as the
lockstep rule, and a nondeterministic one (GPU atomics, bf16) to a multiple of its own
run-to-run noise. Plain JSON with floats at full precision (repr), no NaN: a golden is a clean
run by definition.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sp_harness.judge.bands import EPS, Failure, GateBands, summarize
from sp_harness.record.records import StepRecord, series

DEFAULT_METRICS = ("loss", "grad_norm")


def make_golden(
    runs: Sequence[Sequence[StepRecord]],
    *,
    metrics: Sequence[str] = DEFAULT_METRICS,
    interval: int = 1,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A golden from N >= 1 repeats of one configuration (each a run's records).

    Every repeat must cover the same steps, without gaps at the sampled ones. `meta` should
    carry at least "dtype" (compare_to_golden uses it for the tight band).
    """
    if not runs:
        raise ValueError("make_golden needs at least one run's records")
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    step_sets = [sorted(series(recs, "loss")) for recs in runs]
    if not step_sets[0]:
        raise ValueError("run 0 has no records")
    for i, steps in enumerate(step_sets[1:], 1):
        if steps != step_sets[0]:
            raise ValueError(
                f"repeat {i} covers {len(steps)} steps ({_span(steps)}), repeat 0 covers "
                f"{len(step_sets[0])} ({_span(step_sets[0])}); repeats must cover the same steps"
            )
    start, last = step_sets[0][0], step_sets[0][-1]
    sampled = list(range(start, last + 1, interval))
    end = sampled[-1]
    have = set(step_sets[0])
    gaps = [s for s in sampled if s not in have]
    if gaps:
        raise ValueError(f"runs have no record at sampled steps {gaps[:8]} (interval {interval})")

    out_metrics: dict[str, Any] = {}
    for metric in metrics:
        per_run = [series(recs, metric) for recs in runs]
        values, spread = [], []
        for s in sampled:
            xs = [p[s] for p in per_run]
            bad = [x for x in xs if not math.isfinite(x)]
            if bad:
                raise ValueError(f"{metric} at step {s} is {bad[0]} in a repeat; a golden must be finite")
            lo, hi = min(xs), max(xs)
            # identical repeats store the value itself: a mean of N copies can round off by an ulp
            values.append(lo if lo == hi else math.fsum(xs) / len(xs))
            spread.append(hi - lo)
        out_metrics[metric] = {
            "start_step": start,
            "end_step": end,
            "step_interval": interval,
            "values": values,
            "spread": spread,
        }
    return {
        "metrics": out_metrics,
        "meta": {"num_repeats": len(runs), "run": runs[0][0].run if runs[0] else None, **(meta or {})},
    }


def golden_last_step(golden: Mapping[str, Any]) -> int:
    """The last step any of the golden's metrics has a value for."""
    return max(golden_steps(entry)[-1] for entry in golden["metrics"].values())


def golden_steps(entry: Mapping[str, Any]) -> list[int]:
    """Steps a golden metric entry has values for."""
    return list(range(entry["start_step"], entry["end_step"] + 1, entry["step_interval"]))


def golden_band(
    golden: Mapping[str, Any], metric: str, *, dtype: str | None = None, bands: GateBands = GateBands()
) -> dict[int, tuple[float, float]]:
    """step -> (golden value, band) for one metric: what compare_to_golden checks and the
    report draws."""
    entry = golden["metrics"][metric]
    eff = _effective_dtype(golden, dtype)
    return {
        s: (v, bands.golden(eff, v, sp, s))
        for s, v, sp in zip(golden_steps(entry), entry["values"], entry["spread"], strict=True)
    }


def compare_to_golden(
    records: Sequence[StepRecord],
    golden: Mapping[str, Any],
    *,
    dtype: str | None = None,
    bands: GateBands = GateBands(),
    metrics: Sequence[str] | None = None,
    last_step: int | None = None,
) -> list[Failure]:
    """Failures of one run's records against a golden (empty list: inside the band).

    `last_step`: the last step the run was planned to reach; golden steps after it are not
    compared (a shorter run gates the golden's common prefix), those up to it must all be there.

    `dtype` is the run's dtype; the tight band uses the coarser of it and the golden's
    meta["dtype"], since a float32 run can only match a float64 golden to float32 rounding.
    """
    if not records:
        raise ValueError("no records to compare to the golden")
    run = records[0].run
    label = str(golden.get("meta", {}).get("name", "golden"))
    out: list[Failure] = []
    for metric in metrics if metrics is not None else list(golden["metrics"]):
        if metric not in golden["metrics"]:
            raise ValueError(f"golden has no metric {metric!r}; it has {sorted(golden['metrics'])}")
        have = series(records, metric)
        missing, bad = [], []
        for s, (value, band) in golden_band(golden, metric, dtype=dtype, bands=bands).items():
            if last_step is not None and s > last_step:
                continue
            if s not in have:
                missing.append(s)
                continue
            diff = abs(have[s] - value)
            if not diff <= band:  # "not <=" so NaN fails
                bad.append((s, diff, band))
        if missing:
            out.append(
                Failure(
                    rule="golden",
                    metric=metric,
                    run=run,
                    other=label,
                    step=missing[0],
                    value=math.nan,
                    band=0.0,
                    num_failing_steps=len(missing),
                    detail=f"run has no record at {len(missing)} golden steps, first {missing[0]}",
                )
            )
        out += summarize(
            rule="golden",
            metric=metric,
            run=run,
            other=label,
            violations=bad,
            detail=f"max({bands.golden_spread_factor:g}*spread, {bands.describe(_effective_dtype(golden, dtype))})",
        )
    return out


def save_golden(path: str | os.PathLike, golden: Mapping[str, Any]) -> Path:
    _validate(golden, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def load_golden(path: str | os.PathLike) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        golden = json.load(f)
    _validate(golden, str(path))
    return golden


def _validate(golden: Mapping[str, Any], where: str) -> None:
    if "metrics" not in golden or not isinstance(golden["metrics"], Mapping):
        raise ValueError(f"{where}: golden has no 'metrics' object")
    for metric, entry in golden["metrics"].items():
        missing = {"start_step", "end_step", "step_interval", "values", "spread"} - set(entry)
        if missing:
            raise ValueError(f"{where}: metric {metric!r} lacks {sorted(missing)}")
        if entry["step_interval"] < 1:
            raise ValueError(f"{where}: metric {metric!r} step_interval {entry['step_interval']} < 1")
        n = len(golden_steps(entry))
        if len(entry["values"]) != n or len(entry["spread"]) != n:
            raise ValueError(
                f"{where}: metric {metric!r} spans {n} steps ({entry['start_step']}..{entry['end_step']} "
                f"every {entry['step_interval']}) but has {len(entry['values'])} values and "
                f"{len(entry['spread'])} spreads"
            )
    dtype = golden.get("meta", {}).get("dtype")
    if dtype is not None and dtype not in EPS:
        raise ValueError(f"{where}: meta.dtype {dtype!r} is not one of {sorted(EPS)}")


def _effective_dtype(golden: Mapping[str, Any], dtype: str | None) -> str:
    stored = golden.get("meta", {}).get("dtype")
    candidates = [d for d in (dtype, stored) if d is not None]
    if not candidates:
        raise ValueError("no dtype: pass dtype= or store meta['dtype'] in the golden")
    for d in candidates:
        GateBands.eps(d)
    return max(candidates, key=lambda d: EPS[d])


def _span(steps: Sequence[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"
