"""Stage: judge. The PASS/FAIL decision on a set of convergence runs.

Pure: step records in, a `GateResult` out; no torch, no files, no process groups. The report
draws the same bands this module judges with, so `GateBands` is the single place they live.

Rules, all applied to every run:

  steps      every run records the same steps (a run that stopped early is a failure);
  nonfinite  loss and grad_norm are finite;
  lockstep   for each pair of runs (sp-tp, sp-ref, tp-ref by default) and each lockstep metric
             (loss, grad_norm), |a - b| <= GateBands.tight(dtype, |ref value|, step);
  drift      max_replica_drift <= drift_tolerance (0.0: replicated parameters must stay
             bit-identical across ranks), naming the parameter that drifted;
  golden     optionally, each run's curves stay inside a golden file's band (sp_harness.judge.golden).

The lockstep band (why it looks the way it does). The runs start from identical weights and
see identical batches; a correct parallel run differs from the reference only in the order of
floating-point reductions (sequence-shard sums, tensor-parallel all-reduces). Such a reordering
changes a mean loss of size L by a few ulps, i.e. ~eps(dtype) * L, so the band is

    band(step) = k * eps(dtype) * max(1, |L_ref(step)|) * sqrt(1 + step / growth_steps)

with k = 64 and growth_steps = 100 (with no reference run, |L_ref| is the largest |L| of any
run at that step). max(1, .) keeps the band from collapsing when the metric
nears 0. The sqrt factor is there because the runs' trajectories do separate slowly: Adam turns
a rounding-level gradient difference on a near-zero gradient entry into an O(lr) update
difference, and those accumulate like a random walk. Measured on the reference GPT (h=32,
2 layers, vocab 64, AdamW lr 1e-2, Markov data) against itself with its gradient accumulated
from two half-batches (a pure reduction-order change): float32 loss differences of
~1 eps*L at the first steps (matching correct SP vs reference, ~5e-7 at L~4), at most 4.3 eps*L
over 200 steps, 10 over 400, 38 over 1000; grad-norm differences at most 17.5 eps*max(1,|g|) over
400 steps; float64 at most 5.2 eps*L over 300 steps. The band is 64 at step 0, 111 at step 200,
143 at step 400, 212 at step 1000 (same units): 5-25x headroom, and still only 3.1e-5 at L~4 in
float32 (7.6e-6 relative; 5.7e-14 in float64), far below what real SP bugs do (a missing norm-weight all-reduce moves the loss by
1e-5 within two steps and 1e-3 later, and drifts the replicas at the first update). The
constants depend on the dtype only, never on the case.

`dtype` is the dtype the compared values are computed and reduced in. A bf16-autocast run
reduces its loss in float32 and should be judged as float32; dtype='bfloat16' gives
64 * 2^-7 = 0.5 * L, which checks nothing. Nondeterministic runs (GPU atomics) are not
lockstep-comparable at all; for them the golden band (spread of repeated runs) is the check.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sp_harness.judge.bands import EPS, FAIL, PASS, Failure, GateBands, summarize
from sp_harness.judge.golden import compare_to_golden, golden_last_step
from sp_harness.record.records import StepRecord, series

# EPS, PASS, FAIL, GateBands, Failure and summarize live in sp_harness.judge.bands (shared with
# the golden comparison); they are re-exported here, where readers of a gate result look first
__all__ = ["EPS", "FAIL", "PASS", "Failure", "GateBands", "GateResult", "default_pairs", "evaluate", "lockstep_scale",
           "summarize"]



@dataclass(kw_only=True, frozen=True)
class GateResult:
    """The gate's decision and everything the report needs to explain it."""

    verdict: str
    """'PASS' or 'FAIL'."""
    failures: tuple[Failure, ...]
    """One entry per violated (rule, metric, run[, other]), earliest first."""
    dtype: str
    """Dtype the bands were computed for."""
    bands: GateBands
    reference: str | None
    """Run whose values scale the lockstep band (None if no run had the reference's name)."""
    pairs: tuple[tuple[str, str], ...]
    """Run pairs compared in lockstep, in report order."""
    checked: dict[str, int] = field(default_factory=dict)
    """Comparisons made per rule (so a PASS with 0 comparisons is visible as such)."""
    notes: tuple[str, ...] = ()
    """What the reader must know about what was compared (a golden gated over a prefix only)."""

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    @property
    def reasons(self) -> list[str]:
        return [f.reason() for f in self.failures]

    @property
    def first_failure(self) -> Failure | None:
        return self.failures[0] if self.failures else None

    @property
    def first_failing_step(self) -> int | None:
        return self.failures[0].step if self.failures else None

    @property
    def first_failing_metric(self) -> str | None:
        return self.failures[0].metric if self.failures else None

    @property
    def first_failing_param(self) -> str | None:
        """The drifted parameter of the earliest drift failure, if any run drifted."""
        drift = [f for f in self.failures if f.rule == "drift"]
        return drift[0].param if drift else None

    @property
    def first_failing_run(self) -> str | None:
        return self.failures[0].run if self.failures else None

    def to_json(self) -> dict[str, Any]:
        first = self.first_failure
        return {
            "verdict": self.verdict,
            "reasons": self.reasons,
            "first_failing_step": self.first_failing_step,
            "first_failing_metric": self.first_failing_metric,
            "first_failing_rule": first.rule if first else None,
            "first_failing_run": self.first_failing_run,
            "first_failing_param": self.first_failing_param,
            "dtype": self.dtype,
            "bands": {**dataclasses.asdict(self.bands), "lockstep": self.bands.describe(self.dtype)},
            "reference": self.reference,
            "pairs": [list(p) for p in self.pairs],
            "checked": dict(self.checked),
            "notes": list(self.notes),
            "failures": [f.to_json() for f in self.failures],
        }


def default_pairs(names: Sequence[str], reference: str | None = "ref") -> tuple[tuple[str, str], ...]:
    """Later runs against earlier ones, then each against the reference: for (ref, tp, sp)
    that is (sp, tp), (sp, ref), (tp, ref)."""
    others = [n for n in names if n != reference]
    pairs = [(b, a) for a, b in itertools.combinations(others, 2)][::-1]
    if reference is not None and reference in names:
        pairs += [(n, reference) for n in reversed(others)]
    return tuple(pairs)


def evaluate(
    runs: Mapping[str, Sequence[StepRecord]],
    *,
    dtype: str,
    bands: GateBands = GateBands(),
    reference: str | None = "ref",
    pairs: Sequence[tuple[str, str]] | None = None,
    golden: Mapping[str, Any] | None = None,
    golden_runs: Sequence[str] | None = None,
    num_steps: int | None = None,
) -> GateResult:
    """Judge runs by name. `golden` (a dict from sp_harness.judge.golden) is compared against
    `golden_runs` (default: every run), over the steps the runs were planned to take
    (`num_steps`; None: all the golden's)."""
    if not runs:
        raise ValueError("no runs to judge")
    GateBands.eps(dtype)  # validates the name before any work
    names = list(runs)
    pairs = default_pairs(names, reference) if pairs is None else tuple((a, b) for a, b in pairs)
    for a, b in pairs:
        if a not in runs or b not in runs:
            raise ValueError(f"pair ({a!r}, {b!r}) names a run not in {names}")
    ref_name = reference if reference in runs else None
    checked = {"steps": 0, "nonfinite": 0, "lockstep": 0, "drift": 0, "golden": 0}
    failures: list[Failure] = []

    failures += _check_steps(runs, checked)
    for name, records in runs.items():
        failures += _check_nonfinite(name, records, bands, checked)
        failures += _check_drift(name, records, bands, checked)
    for metric in bands.lockstep_metrics:
        scale = lockstep_scale(runs, metric, ref_name)
        for a, b in pairs:
            failures += _check_lockstep(runs, a, b, scale, metric, dtype, bands, checked)
    notes: list[str] = []
    last_step = None
    if golden is not None and num_steps is not None:
        golden_last = golden_last_step(golden)
        if num_steps - 1 < golden_last:
            last_step = num_steps - 1
            notes.append(f"golden gated over its steps 0-{last_step} only: this run has {num_steps} steps, "
                         f"the golden {golden_last + 1}")
        elif num_steps - 1 > golden_last:
            notes.append(f"steps {golden_last + 1}-{num_steps - 1} have no golden: the golden has {golden_last + 1} steps")
    if golden is not None:
        for name in golden_runs if golden_runs is not None else names:
            if name not in runs:
                raise ValueError(f"golden_runs names {name!r}, not one of {names}")
            found = compare_to_golden(runs[name], golden, dtype=dtype, bands=bands, last_step=last_step)
            checked["golden"] += 1
            failures += found

    failures.sort(key=lambda f: f.sort_key)
    return GateResult(
        verdict=FAIL if failures else PASS,
        failures=tuple(failures),
        dtype=dtype,
        bands=bands,
        reference=ref_name,
        pairs=pairs,
        checked=checked,
        notes=tuple(notes),
    )


def lockstep_scale(
    runs: Mapping[str, Sequence[StepRecord]], metric: str, reference: str | None
) -> dict[int, float]:
    """step -> the magnitude the lockstep band scales with: the reference run's value, or with
    no reference run the largest |value| of any run at that step (the loosest honest choice)."""
    if reference is not None and reference in runs:
        return series(runs[reference], metric)
    out: dict[int, float] = {}
    for records in runs.values():
        for step, value in series(records, metric).items():
            if math.isfinite(value):
                out[step] = max(out.get(step, 0.0), abs(value))
    return out


def _check_steps(runs: Mapping[str, Sequence[StepRecord]], checked: dict[str, int]) -> list[Failure]:
    steps = {name: sorted(series(recs, "loss")) for name, recs in runs.items()}
    union = sorted(set().union(*map(set, steps.values())))
    out = []
    for name, have in steps.items():
        checked["steps"] += 1
        missing = sorted(set(union) - set(have))
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            out.append(
                Failure(
                    rule="steps",
                    metric="step",
                    run=name,
                    step=missing[0],
                    value=float(len(have)),
                    band=float(len(union)),
                    num_failing_steps=len(missing),
                    detail=(
                        f"recorded {len(have)} of the {len(union)} steps the runs cover; "
                        f"missing step {shown}"
                    ),
                )
            )
    return out


def _check_nonfinite(
    name: str, records: Sequence[StepRecord], bands: GateBands, checked: dict[str, int]
) -> list[Failure]:
    out = []
    for metric in ("loss", *[m for m in bands.lockstep_metrics if m != "loss"]):
        values = series(records, metric)
        bad = [(s, v, math.inf) for s, v in sorted(values.items()) if not math.isfinite(v)]
        checked["nonfinite"] += len(values)
        out += summarize(rule="nonfinite", metric=metric, run=name, other=None, violations=bad)
    return out


def _check_drift(
    name: str, records: Sequence[StepRecord], bands: GateBands, checked: dict[str, int]
) -> list[Failure]:
    bad = []
    for r in sorted(records, key=lambda r: r.step):
        checked["drift"] += 1
        # written as "not <=" so a NaN drift (a rank that diverged to NaN) fails too
        if not r.max_replica_drift <= bands.drift_tolerance:
            bad.append(r)
    if not bad:
        return []
    first = bad[0]
    over = [
        (p, d) for p, d in first.replica_drift.items() if not d <= bands.drift_tolerance
    ]
    over.sort(key=lambda pd: (-(math.inf if math.isnan(pd[1]) else pd[1]), pd[0]))
    (failure,) = summarize(
        rule="drift",
        metric="max_replica_drift",
        run=name,
        other=None,
        violations=[(r.step, r.max_replica_drift, bands.drift_tolerance) for r in bad],
    )
    return [
        dataclasses.replace(
            failure,
            param=over[0][0] if over else None,
            params=tuple(p for p, _ in over),
        )
    ]


def _check_lockstep(
    runs: Mapping[str, Sequence[StepRecord]],
    a: str,
    b: str,
    scale: Mapping[int, float],
    metric: str,
    dtype: str,
    bands: GateBands,
    checked: dict[str, int],
) -> list[Failure]:
    va, vb = series(runs[a], metric), series(runs[b], metric)
    bad = []
    for step in sorted(set(va) & set(vb)):
        x, y = va[step], vb[step]
        if not (math.isfinite(x) and math.isfinite(y)):
            continue  # reported once by the nonfinite rule, not again for every pair
        band = bands.tight(dtype, scale.get(step, max(abs(x), abs(y))), step)
        diff = abs(x - y)
        checked["lockstep"] += 1
        if not diff <= band:
            bad.append((step, diff, band))
    return summarize(
        rule="lockstep",
        metric=metric,
        run=a,
        other=b,
        violations=bad,
        detail=bands.describe(dtype),
    )
