"""Stage: judge. The gate's tolerances (`GateBands`), its failure record (`Failure`) and the one
place a list of violations becomes a failure (`summarize`): shared by the lockstep gate
(sp_harness.judge.gate, where the band's derivation is written up) and the golden comparison
(sp_harness.judge.golden), neither of which imports the other for them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sp_harness.record.records import StepRecord

EPS: dict[str, float] = {
    "float64": 2.0**-52,
    "float32": 2.0**-23,
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
}
"""Machine epsilon per dtype name (= torch.finfo(dtype).eps), kept here so the gate needs no torch."""

PASS = "PASS"
FAIL = "FAIL"

# rules evaluated on values measured before a step's update sort before those measured after it
_BEFORE_UPDATE = {"loss", "grad_norm", "steps"}


@dataclass(kw_only=True, frozen=True)
class GateBands:
    """Tolerances of the gate, as formulas of dtype and step (see the module docstring)."""

    lockstep_k: float = 64.0
    """Band in units of eps(dtype) * max(1, |reference value|) at step 0."""
    growth_steps: float = 100.0
    """The band grows as sqrt(1 + step / growth_steps): slow trajectory separation from
    rounding. math.inf disables growth."""
    lockstep_metrics: tuple[str, ...] = ("loss", "grad_norm")
    """StepRecord fields compared between runs step by step."""
    drift_tolerance: float = 0.0
    """Largest allowed max_replica_drift. 0.0: replicas must be bit-identical."""
    golden_spread_factor: float = 2.0
    """Golden band = max(golden_spread_factor * spread, tight band): |x - golden mean| may be
    twice the range of the repeats that made the golden. With 3 repeats the expected range is
    ~1.7 sigma, so the band is ~3.4 sigma around the mean."""

    def __post_init__(self) -> None:
        if not (self.lockstep_k > 0 and math.isfinite(self.lockstep_k)):
            raise ValueError(f"lockstep_k must be finite and > 0, got {self.lockstep_k}")
        if not self.growth_steps > 0:
            raise ValueError(f"growth_steps must be > 0 (math.inf for none), got {self.growth_steps}")
        if not self.drift_tolerance >= 0:
            raise ValueError(f"drift_tolerance must be >= 0, got {self.drift_tolerance}")
        if not self.golden_spread_factor >= 0:
            raise ValueError(f"golden_spread_factor must be >= 0, got {self.golden_spread_factor}")
        known = {f.name for f in dataclasses.fields(StepRecord)}
        bad = [m for m in self.lockstep_metrics if m not in known]
        if bad:
            raise ValueError(f"lockstep_metrics {bad} are not StepRecord fields {sorted(known)}")

    @staticmethod
    def eps(dtype: str) -> float:
        if dtype not in EPS:
            raise ValueError(f"dtype must be one of {sorted(EPS)}, got {dtype!r}")
        return EPS[dtype]

    def tight(self, dtype: str, scale: float, step: int) -> float:
        """k * eps(dtype) * max(1, |scale|) * sqrt(1 + step / growth_steps)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        mag = abs(scale)
        # a NaN reference gets the smallest band: the nonfinite rule reports it anyway
        mag = 1.0 if not math.isfinite(mag) else max(1.0, mag)
        return self.lockstep_k * self.eps(dtype) * mag * math.sqrt(1.0 + step / self.growth_steps)

    def golden(self, dtype: str, value: float, spread: float, step: int) -> float:
        """max(golden_spread_factor * spread, tight(dtype, value, step))."""
        return max(self.golden_spread_factor * spread, self.tight(dtype, value, step))

    def describe(self, dtype: str) -> str:
        """The lockstep formula with this dtype's numbers, for reasons and plot legends."""
        growth = "" if math.isinf(self.growth_steps) else f"*sqrt(1+step/{self.growth_steps:g})"
        return f"{self.lockstep_k:g}*eps({dtype})*max(1,|ref|){growth}"


@dataclass(kw_only=True, frozen=True)
class Failure:
    """One violated rule for one run (or pair of runs): where it first failed and how badly."""

    rule: str
    """'crash', 'steps', 'nonfinite', 'lockstep', 'drift' or 'golden'."""
    metric: str
    """StepRecord field: 'loss', 'grad_norm', 'max_replica_drift', or 'step' for 'steps'."""
    run: str
    """The run at fault (for lockstep, the first of the pair)."""
    other: str | None = None
    """Lockstep: the run compared against. Golden: the golden's label."""
    step: int
    """First step at which the rule is violated."""
    value: float
    """Violating value at `step` (|a - b| for lockstep and golden, the drift, the metric)."""
    band: float
    """Allowed value at `step`."""
    param: str | None = None
    """Drift: the parameter with the largest cross-rank difference at `step`."""
    params: tuple[str, ...] = ()
    """Drift: every parameter over tolerance at `step`, largest first."""
    num_failing_steps: int = 1
    """Steps at which this rule fails for this run or pair."""
    worst_step: int | None = None
    """Step with the largest value / band."""
    worst_value: float | None = None
    worst_band: float | None = None
    detail: str = ""
    """Extra words for the reason (missing steps, the band formula)."""

    @property
    def sort_key(self) -> tuple[int, int]:
        # losses are measured before a step's update, drift after it: drift after step 1's
        # update (2*1+1) happened before the loss of step 2 (2*2) went wrong
        return (2 * self.step + (0 if self.metric in _BEFORE_UPDATE else 1), _RULE_ORDER[self.rule])

    def reason(self) -> str:
        who = f"{self.run} vs {self.other}" if self.rule == "lockstep" else self.run
        if self.rule == "drift":
            head = (
                f"{who}: replicas diverged after the update of step {self.step}: "
                f"{self.param or '(parameter not recorded)'} differs across ranks by "
                f"{self.value:.6g} > tolerance {self.band:g}"
            )
            if len(self.params) > 1:
                shown = ", ".join(self.params[:5]) + (", ..." if len(self.params) > 5 else "")
                head += f"; {len(self.params)} parameters drifted ({shown})"
        elif self.rule == "crash":
            head = f"{who}: crashed at step {self.step}: {self.detail}"
        elif self.rule == "steps":
            head = f"{who}: {self.detail}"
        elif self.rule == "nonfinite":
            head = f"{who}: {self.metric} is {self.value} at step {self.step}"
        else:
            what = f"|{self.metric} diff|" if self.rule == "lockstep" else f"|{self.metric} - golden|"
            head = (
                f"{who}: {what} = {self.value:.3e} at step {self.step} "
                f"exceeds band {self.band:.3e}"
            )
            if self.detail:
                head += f" ({self.detail})"
        if self.num_failing_steps > 1 and self.worst_step is not None:
            head += f"; fails at {self.num_failing_steps} steps"
            if self.worst_step != self.step and self.worst_value is not None:
                head += f", worst {self.worst_value:.3e} at step {self.worst_step}"
                if self.worst_band:
                    head += f" (band {self.worst_band:.3e})"
        return head

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["params"] = list(self.params)
        out["reason"] = self.reason()
        return out


_RULE_ORDER = {"crash": -1, "steps": 0, "nonfinite": 1, "drift": 2, "lockstep": 3, "golden": 4}


def summarize(
    *,
    rule: str,
    metric: str,
    run: str,
    other: str | None,
    violations: Sequence[tuple[int, float, float]],
    detail: str = "",
) -> list[Failure]:
    """One Failure from (step, value, band) violations in step order (empty -> none)."""
    if not violations:
        return []
    step, value, band = violations[0]

    def badness(v: tuple[int, float, float]) -> float:
        ratio = v[1] / v[2] if v[2] > 0 else math.inf
        return math.inf if math.isnan(ratio) else ratio

    worst = max(violations, key=badness)
    return [
        Failure(
            rule=rule,
            metric=metric,
            run=run,
            other=other,
            step=step,
            value=value,
            band=band,
            num_failing_steps=len(violations),
            worst_step=worst[0],
            worst_value=worst[1],
            worst_band=worst[2],
            detail=detail,
        )
    ]
