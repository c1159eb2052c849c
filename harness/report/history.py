"""Stage: report. The nightly history: one JSON line per nightly run (`nightly-history.jsonl`
beside the report directory) and this run's key figures drawn against the earlier runs', the
regression view Megatron's golden values and torchtitan's loss comparisons give their users."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

SCHEMA_VERSION = 1
HISTORY_FILE = "nightly-history.jsonl"
FIGURES = (("final_loss", "final loss (case run)"), ("lockstep_max_abs", "max |loss(sp) - loss(ref)| over steps"),
           ("wall_s", "wall time s"), ("tokens_per_s", "tokens/s (case run, median)"))
"""(field, axis label): what the history plot draws, one panel each."""


@dataclass(kw_only=True, frozen=True)
class HistoryEntry:
    timestamp: str
    """UTC, ISO 8601."""
    case: str
    """The convergence run's case."""
    num_steps: int
    checks_ok: int
    """Case checks whose verdict was the expected one."""
    num_checks: int
    gate: str
    """The convergence gate's verdict."""
    final_loss: float
    lockstep_max_abs: float
    """Largest |loss(case) - loss(reference)| over the run's steps."""
    wall_s: float
    tokens_per_s: float
    sp_harness_commit: str | None = None
    torch: str | None = None
    cpu_capability: str | None = None
    host: str | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def label(self) -> str:
        commit = (self.sp_harness_commit or "")[:7]
        return f"{self.timestamp[5:16]}" + (f"\n{commit}" if commit else "")


def history_path(out: str | os.PathLike) -> Path:
    """Where a report directory's nightly history lives: beside it, shared by its runs."""
    out = Path(out)
    return out.parent / HISTORY_FILE


def append(path: str | os.PathLike, entry: HistoryEntry) -> None:
    """One line, written with a single append (concurrent runs interleave whole lines)."""
    line = json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in asdict(entry).items()}) + "\n"
    with open(path, "a") as f:
        f.write(line)


def read(path: str | os.PathLike) -> list[HistoryEntry]:
    """Every entry of a history file, oldest first; lines of another schema or broken (a run
    killed mid-write) are skipped."""
    known = {f.name for f in fields(HistoryEntry)}
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
            continue
        doc = {k: (math.nan if v is None and k in ("final_loss", "lockstep_max_abs", "wall_s", "tokens_per_s") else v)
               for k, v in doc.items() if k in known}
        try:
            out.append(HistoryEntry(**doc))
        except TypeError:
            continue
    return out


def plot(entries: list[HistoryEntry], out_png: str | os.PathLike, *, last: int = 30) -> Path:
    """The last `last` runs' key figures, one panel per figure; the newest run (this one) in red."""
    shown = entries[-last:]
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    xs = list(range(len(shown)))
    for ax, (name, label) in zip(axes, FIGURES, strict=True):
        ys = [getattr(e, name) for e in shown]
        ax.plot(xs, ys, color="tab:blue", marker="o", ms=4, lw=1.2)
        if shown:
            ax.plot([xs[-1]], [ys[-1]], color="red", marker="o", ms=8, ls="none", label="this run")
            failed = [(x, y) for x, y, e in zip(xs, ys, shown, strict=True) if e.gate != "PASS" or e.checks_ok < e.num_checks]
            if failed:
                ax.plot(*zip(*failed, strict=True), color="black", marker="x", ms=8, ls="none", label="run that failed")
        if name == "lockstep_max_abs" and any(y > 0 for y in ys if math.isfinite(y)):
            ax.set_yscale("symlog", linthresh=min(y for y in ys if math.isfinite(y) and y > 0))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xticks(xs, [e.label for e in shown], rotation=60, fontsize=6)
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle(f"Nightly history: the last {len(shown)} run(s) of {shown[-1].case if shown else '?'}")
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    return out_png


def entry_from(*, case: str, runs: dict[str, list[Any]], rows: list[dict], gate: str, wall_s: float,
               environment: dict[str, Any]) -> HistoryEntry:
    """This nightly run's entry: `runs` are the convergence records by run name."""
    sp, ref = runs.get("sp") or [], runs.get("ref") or []
    ref_loss = {r.step: r.loss for r in ref}
    diffs = [abs(r.loss - ref_loss[r.step]) for r in sp if r.step in ref_loss]
    tps = sorted(r.tokens_per_s for r in sp if math.isfinite(r.tokens_per_s))
    return HistoryEntry(
        timestamp=environment.get("timestamp", ""), case=case, num_steps=len(sp),
        checks_ok=sum(bool(r["ok"]) for r in rows), num_checks=len(rows), gate=gate,
        final_loss=sp[-1].loss if sp else math.nan, lockstep_max_abs=max(diffs, default=math.nan), wall_s=wall_s,
        tokens_per_s=tps[len(tps) // 2] if tps else math.nan, sp_harness_commit=environment.get("sp_harness_commit"),
        torch=environment.get("torch"), cpu_capability=environment.get("cpu_capability"), host=environment.get("host"))
