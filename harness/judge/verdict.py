"""Stage: judge. The side-by-side check's verdict: each rank's judged tensors (`RankResult`, filled
by `record` on the rank) merged into one `CheckResult` (its table: sp_harness.report.result_text).

Verdicts: PASS (every judged tensor within tolerance, no replica drift), UNSUPPORTED (the case
declared the config out of scope), FAIL (wrong numbers, drift, a crash, hang or collective
mismatch while the code under test runs its steps), ERROR (a crash or hang before its first step:
loading the case, its setup, building the reference, `shard()`, building the training step; the
check could not run, so it says nothing about the code's numbers). A FAIL carries the first
failure (earliest step, then forward < loss < input grad < grad < param), the worst ones, and the
one-line repro.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sp_harness.capture.comm import CommRow
from sp_harness.capture.islands import Island, declared_islands
from sp_harness.compare.divergence import Divergence
from sp_harness.compare.tensor_check import KIND_ORDER, TensorCheck
from sp_harness.config.check_config import CheckConfig
from sp_harness.launch.failure import RankError
from sp_harness.step.params import Drift

PASS, FAIL, UNSUPPORTED, ERROR = "PASS", "FAIL", "UNSUPPORTED", "ERROR"

MAX_FAILURES_KEPT = 64


@dataclass(kw_only=True)
class RankResult:
    rank: int
    failures: list[TensorCheck] = field(default_factory=list)
    worst: dict[str, TensorCheck] = field(default_factory=dict)
    """Largest ratio per kind, passing or not."""
    worst_norm: dict[str, TensorCheck] = field(default_factory=dict)
    """Largest norm-wise ratio per kind (the bound that makes low precision sharp), passing or not."""
    worst_scale: TensorCheck | None = None
    """Largest recorded coherent grad scale ratio (TensorCheck.scale_ratio; not judged)."""
    drift: list[Drift] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: list[list[CommRow]] = field(default_factory=list)
    """Per step, the collective counter's rows."""
    num_checks: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    divergence: Divergence | None = None
    """At the first failing step: the first module whose output or input grad left its bound."""
    islands: list[Island] = field(default_factory=list)
    """Ops of the sharded forward and backward at step 0 that computed below the run dtype."""
    not_run: list[str] = field(default_factory=list)
    """Checks the case asked for that could not run, each with why (an attention module that
    exposes an LSE under a name the reference has no LSE for)."""
    withheld: list[TensorCheck] = field(default_factory=list)
    """Every piece not judged because its bounds would pass a zero tensor (TensorCheck.vacuous);
    `merge` picks each tensor's first (to name) and its largest would-be ratio (to record)."""
    grad_factor: float | None = None
    """Training-step check, where its grads failed: the one factor that maps the reference's grads
    onto the run's to 5% rms (sp_harness.checks.train_step_rank.UNIFORM_FIT); None where none does."""
    findings: list[str] = field(default_factory=list)
    """Params whose declared mapping (the case's, the framework's sharding metadata) contradicts
    their shape, mapped by the shape instead (`ParamSpec.finding`): reported, not judged."""


def record(result: RankResult, chk: TensorCheck) -> None:
    if chk.vacuous:
        result.withheld.append(chk)
        return
    result.num_checks += 1
    best = result.worst.get(chk.kind)
    if best is None or chk.ratio > best.ratio:
        result.worst[chk.kind] = chk
    best = result.worst_norm.get(chk.kind)
    if chk.norm_ratio and (best is None or chk.norm_ratio > best.norm_ratio):
        result.worst_norm[chk.kind] = chk
    if chk.kind == "grad" and chk.scale_ratio and (result.worst_scale is None or chk.scale_ratio > result.worst_scale.scale_ratio):
        result.worst_scale = chk
    if not chk.ok and len(result.failures) < MAX_FAILURES_KEPT:
        result.failures.append(chk)


@dataclass(kw_only=True)
class CheckResult:
    config: CheckConfig
    verdict: str
    reason: str = ""
    failures: list[TensorCheck] = field(default_factory=list)
    worst: dict[str, TensorCheck] = field(default_factory=dict)
    worst_norm: dict[str, TensorCheck] = field(default_factory=dict)
    """Largest norm-wise ratio per kind over all ranks (RankResult.worst_norm)."""
    worst_scale: TensorCheck | None = None
    """Largest recorded coherent grad scale ratio over all ranks (RankResult.worst_scale)."""
    drift: list[Drift] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: list[CommRow] = field(default_factory=list)
    """Collective rows of step 0 on rank 0 (every step and rank count the same in a correct run)."""
    error: str = ""
    """For a crash or hang: the ranks' tracebacks."""
    crash_kind: str = ""
    """For a crash or hang: how the first failing rank failed, 'desync' (its collectives did not
    pair up with another rank's), 'raised', 'exited', 'signal' or 'timeout'
    (sp_harness.launch.failure.RankFailure.kind); '' otherwise. `first_check` calls every one but
    a timeout a 'crash': the run could not complete."""
    rank_errors: tuple[RankError, ...] = ()
    """For a crash or hang: each failing rank's error, the first to fail first."""
    wall_s: float = 0.0
    num_checks: int = 0
    divergence: Divergence | None = None
    """The first module (execution order) whose output or input grad left its bound, at the
    first failing step, on the lowest rank that saw one (sp_harness.capture.trace)."""
    islands: list[Island] = field(default_factory=list)
    """Precision islands: each distinct op the sharded run computed below the run dtype (any
    rank, step 0; sp_harness.capture.islands), then those the case declared."""
    not_run: list[str] = field(default_factory=list)
    """Checks that could not run, each with why, over all ranks (RankResult.not_run)."""
    vacuous: list[TensorCheck] = field(default_factory=list)
    """Tensors not judged because their bounds would pass a zero tensor, one piece each (the
    earliest step, then the lowest rank; RankResult.withheld)."""
    withheld_worst: list[TensorCheck] = field(default_factory=list)
    """The same tensors, each as its withheld piece with the largest would-be ratio over every
    step and rank (TensorCheck.withheld_ratio; recorded, not judged)."""
    grad_factor: float | None = None
    """Training-step check: every param grad is this factor times the reference's (a loss
    normalisation or averaging error); None where the grads passed or no one factor fits."""
    findings: list[str] = field(default_factory=list)
    """Each param whose declared mapping contradicts its shape, over all ranks (RankResult.findings):
    the check mapped it by its shape and went on judging."""

    @property
    def not_judged(self) -> tuple[str, ...]:
        """Check kinds this run did not judge: a forward-only run has no grads and no update."""
        return ("input_grad", "grad", "param") if self.config.forward_only else ()

    @property
    def ok(self) -> bool:
        """PASS or UNSUPPORTED: neither a FAIL nor an ERROR."""
        return self.verdict in (PASS, UNSUPPORTED)

    @property
    def first_failure(self) -> str:
        items = []
        if self.failures:
            items.append((self.failures[0].sort_key()[:2], self.failures[0].describe()))
        if self.drift:
            d = self.drift[0]
            items.append(((d.step, len(KIND_ORDER)), d.describe()))
        return min(items)[1] if items else self.reason

    @property
    def first_check(self) -> str:
        """Which check caught a FAIL first: a tensor check's kind ('init', 'forward', ..., 'param'),
        'replica drift' where that came at an earlier step, 'crash', 'hang (timeout)'; for an
        ERROR 'setup'; '' if none."""
        if self.verdict == ERROR:
            return "setup"
        if self.error:
            return "hang (timeout)" if self.crash_kind == "timeout" else "crash"
        if self.failures:
            first = self.failures[0]
            if self.drift and self.drift[0].step < first.step:
                return "replica drift"
            return first.kind
        return "replica drift" if self.drift else ""

    @property
    def failing_names(self) -> list[str]:
        """Tensor names failing at the first failing step, in order."""
        if not self.failures:
            return [d.name for d in self.drift if d.step == self.drift[0].step] if self.drift else []
        step = self.failures[0].step
        seen: dict[str, None] = {}
        for f in self.failures:
            if f.step == step:
                seen.setdefault(f"{f.kind}:{f.name}")
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        def conv(x):
            if dataclasses.is_dataclass(x):
                return {k: conv(v) for k, v in dataclasses.asdict(x).items()}
            if isinstance(x, dict):
                return {k: conv(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [conv(v) for v in x]
            return x

        return {
            "verdict": self.verdict, "reason": self.reason, "first_failure": self.first_failure if self.verdict == FAIL else "",
            "config": conv(self.config), "repro": self.config.repro(), "failures": conv(self.failures),
            "worst": conv(self.worst), "worst_norm": conv(self.worst_norm),
            "worst_scale": conv(self.worst_scale), "drift": conv(self.drift), "losses": self.losses, "comm": conv(self.comm),
            "error": self.error, "crash_kind": self.crash_kind, "rank_errors": conv(self.rank_errors), "wall_s": self.wall_s, "num_checks": self.num_checks,
            "divergence": conv(self.divergence), "not_judged": list(self.not_judged),
            "islands": conv(self.islands), "not_run": list(self.not_run), "vacuous": conv(self.vacuous),
            "withheld_worst": conv(self.withheld_worst), "grad_factor": self.grad_factor,
            "findings": list(self.findings),
        }


def _worst_over(per_rank: list[dict[str, TensorCheck]], ratio) -> dict[str, TensorCheck]:
    """Per kind, the check with the largest `ratio(check)` over the ranks' worst ones."""
    worst: dict[str, TensorCheck] = {}
    for by_kind in per_rank:
        for kind, chk in by_kind.items():
            if kind not in worst or ratio(chk) > ratio(worst[kind]):
                worst[kind] = chk
    return worst


def _one_per_tensor(checks: list[TensorCheck], *, by_withheld_ratio: bool = False) -> list[TensorCheck]:
    """One check per kind and name, in KIND_ORDER: the earliest (step, then rank), or with
    `by_withheld_ratio` the one with the largest withheld ratio (ties: the earliest)."""
    chosen: dict[tuple[str, str], TensorCheck] = {}
    for chk in sorted(checks, key=lambda c: (c.step, c.rank)):
        best = chosen.get((chk.kind, chk.name))
        if best is None or (by_withheld_ratio and chk.withheld_ratio > best.withheld_ratio):
            chosen[(chk.kind, chk.name)] = chk
    return sorted(chosen.values(), key=lambda c: (KIND_ORDER.index(c.kind), c.name))


def merge(config: CheckConfig, results: list[RankResult], *, wall_s: float = 0.0,
          declared: Mapping[str, str] | None = None) -> CheckResult:
    failures = sorted((f for r in results for f in r.failures), key=TensorCheck.sort_key)
    withheld = [c for r in results for c in r.withheld]
    worst = _worst_over([r.worst for r in results], lambda c: c.ratio)
    worst_norm = _worst_over([r.worst_norm for r in results], lambda c: c.norm_ratio)
    worst_scale = max((r.worst_scale for r in results if r.worst_scale is not None), key=lambda c: c.scale_ratio,
                      default=None)
    drift: dict[tuple[int, str, str], Drift] = {}
    for r in results:
        for d in r.drift:
            key = (d.step, d.group, d.name)
            if key not in drift or d.max_abs > drift[key].max_abs:
                drift[key] = d
    drifts = sorted(drift.values(), key=lambda d: (d.step, d.group, d.name))
    verdict = FAIL if failures or drifts else PASS
    divergences = [r.divergence for r in results if r.divergence is not None]
    divergence = min(divergences, key=Divergence.sort_key, default=None)
    res = CheckResult(config=config, verdict=verdict, failures=failures, worst=worst, worst_norm=worst_norm,
                      worst_scale=worst_scale, drift=drifts,
                      losses=results[0].losses, comm=results[0].comm[0] if results[0].comm else [],
                      wall_s=wall_s, num_checks=sum(r.num_checks for r in results), divergence=divergence,
                      islands=list(dict.fromkeys([i for r in results for i in r.islands]
                                                 + declared_islands(declared or {}))),
                      not_run=list(dict.fromkeys(n for r in results for n in r.not_run)),
                      vacuous=_one_per_tensor(withheld),
                      withheld_worst=_one_per_tensor(withheld, by_withheld_ratio=True),
                      grad_factor=next((r.grad_factor for r in results if r.grad_factor is not None), None),
                      findings=list(dict.fromkeys(f for r in results for f in r.findings)))
    if verdict == FAIL:
        n = len({(f.step, f.kind, f.name) for f in failures})
        res.reason = f"{n} tensor mismatch(es), {len(drifts)} replica drift(s); first: {res.first_failure}"
        if res.grad_factor is not None:
            res.reason += (f"; every param grad is {res.grad_factor:.3f}x the reference: a loss normalisation "
                           f"or averaging error")
    return res
