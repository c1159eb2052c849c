"""Stage: report. The four plots of a lockstep run (matplotlib's object API: Figure + savefig,
rendered by Agg; pyplot is never imported, so no global backend is set, no display is needed and
nothing leaks between calls).

  loss.png       loss curves of every run, the data's loss floor (where known) dashed;
  lockstep.png   |difference| between runs per step (log y) against the gate's band;
  drift.png      max cross-rank difference of replicated parameters per step (log y);
  gradnorm.png   grad-norm ratio between runs per step;
  schedule.png   learning rate and throughput (tokens/s) per step of every run.

A new plot is one `_plot_NAME(runs, meta, gate, colors, golden)` function and its entry in
`MAKERS`. Log axes cannot show 0, and 0 is the most important value here (bit-identical runs or
replicas): zeros are drawn at a floor below every non-zero value, on a dotted line labelled
"0 (bit-identical)", with hollow markers, so "exactly equal" and "tiny" are never confused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib import ticker
from matplotlib.figure import Figure

from sp_harness.judge.gate import GateResult, lockstep_scale
from sp_harness.record.records import StepRecord, series

PLOTS = ("loss", "lockstep", "drift", "gradnorm", "schedule")
MAX_DRIFT_PARAMS = 8
"""Drifting parameters drawn one by one; more are counted in the legend, never dropped silently."""

_COLORS = {"ref": "black", "tp": "tab:blue", "sp": "tab:orange"}
_CYCLE = ("tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
# overlapping curves are the normal case (lockstep runs); distinct widths/dashes keep each visible
_STYLES = ({"lw": 3.5, "alpha": 0.35, "ls": "-"}, {"lw": 1.8, "ls": "--"}, {"lw": 1.4, "ls": ":"})
_DPI = 110


def write_plots(
    out_dir: str | Path,
    runs: Mapping[str, Sequence[StepRecord]],
    meta: Mapping[str, Any],
    gate: GateResult,
    *,
    golden: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Only the four PNGs (no HTML): plot name -> path."""
    if not runs:
        raise ValueError("no runs to plot")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = _colors(runs)
    out = {}
    for name in PLOTS:
        fig = MAKERS[name](runs, meta, gate, colors, golden)
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=_DPI)
        out[name] = path
    return out


# ----------------------------------------------------------------------------------- plots


def _plot_loss(runs, meta, gate: GateResult, colors, golden) -> Figure:
    fig, ax = _figure()
    for i, (name, recs) in enumerate(runs.items()):
        xs, ys = _xy(series(recs, "loss"))
        ax.plot(xs, ys, color=colors[name], label=name, **_style(i), **_markers(xs))
    floor = meta.get("floor")
    if floor is not None and math.isfinite(floor):
        ax.axhline(floor, color="gray", ls="--", lw=1.2, label=f"floor ({floor_label(meta)}) {floor:.4f}")
    if golden is not None and "loss" in golden.get("metrics", {}):
        from sp_harness.judge.golden import golden_band

        gb = golden_band(golden, "loss", dtype=gate.dtype, bands=gate.bands)
        gx = sorted(gb)
        lo = [gb[s][0] - gb[s][1] for s in gx]
        hi = [gb[s][0] + gb[s][1] for s in gx]
        ax.fill_between(gx, lo, hi, color="tab:green", alpha=0.25, label="golden band")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per loss term)")
    ax.set_title(f"Loss: {title(meta)}")
    _mark_failure(ax, gate, lambda f: f.metric == "loss")
    ax.legend(loc="upper right")
    return fig


def _plot_lockstep(runs, meta, gate: GateResult, colors, golden=None) -> Figure:
    if not gate.pairs:
        fig, ax = _figure()
        ax.text(0.5, 0.5, "one run only: nothing to compare in lockstep", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_title(f"Lockstep: {title(meta)}")
        return fig
    metrics = [m for m in ("loss", "grad_norm") if m in gate.bands.lockstep_metrics] or ["loss"]
    fig = Figure(figsize=(11, 3.6 * len(metrics) + 0.6), layout="constrained")
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    for ax, metric in zip(axes, metrics, strict=True):
        curves, band_curve = [], None
        for a, b in gate.pairs:
            va, vb = series(runs[a], metric), series(runs[b], metric)
            steps = sorted(set(va) & set(vb))
            curves.append((a, b, steps, [abs(va[s] - vb[s]) for s in steps]))
        scale = lockstep_scale(runs, metric, gate.reference)
        all_steps = sorted({s for _, _, st, _ in curves for s in st})
        if all_steps:
            band_curve = (
                all_steps,
                [gate.bands.tight(gate.dtype, scale.get(s, 1.0), s) for s in all_steps],
            )
        values = [v for *_, ys in curves for v in ys] + (band_curve[1] if band_curve else [])
        zero = _zero_floor(values)
        for i, (a, b, steps, ys) in enumerate(curves):
            _log_series(ax, steps, ys, zero, color=colors[a] if b == gate.reference else _pair_color(i),
                        label=f"|{metric}[{a}] - {metric}[{b}]|", style=_style(i))
        if band_curve:
            ax.plot(*band_curve, color="red", lw=1.2, ls="-.",
                    label=f"gate band {gate.bands.describe(gate.dtype)}")
            ax.fill_between(band_curve[0], zero, band_curve[1], color="green", alpha=0.07)
        _zero_line(ax, zero)
        _log_axis(ax, zero)
        ax.set_ylabel(f"|{metric} difference|")
        ax.set_title(f"Lockstep {metric}: runs vs each other ({gate.dtype})")
        _mark_failure(ax, gate, lambda f, m=metric: f.rule == "lockstep" and f.metric == m)
        _legend_outside(ax)
    axes[-1].set_xlabel("step")
    fig.suptitle(title(meta), fontsize=10)
    return fig


def _plot_drift(runs, meta, gate: GateResult, colors, golden=None) -> Figure:
    fig, ax = _figure()
    tol = gate.bands.drift_tolerance
    drifting = {n: r for n, r in runs.items() if any(rec.replica_drift for rec in r)}
    if not drifting:
        ax.text(0.5, 0.5, "no run recorded replicated parameters\n(single-device runs only)",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"Replica drift: {title(meta)}")
        return fig
    curves = []
    for name, recs in drifting.items():
        recs = sorted(recs, key=lambda r: r.step)
        curves.append((name, [r.step for r in recs], [r.max_replica_drift for r in recs]))
    # the worst few parameters of the first drifting run say *which* reduction is missing
    params: list[tuple[str, list[int], list[float]]] = []
    first_drift = next((f for f in gate.failures if f.rule == "drift"), None)
    if first_drift is not None:
        recs = sorted(runs[first_drift.run], key=lambda r: r.step)
        for p in first_drift.params[:MAX_DRIFT_PARAMS]:
            params.append((f"{first_drift.run}: {p}", [r.step for r in recs],
                           [r.replica_drift.get(p, 0.0) for r in recs]))
        hidden = len(first_drift.params) - MAX_DRIFT_PARAMS
        if hidden > 0:
            ax.plot([], [], " ", label=f"... and {hidden} more drifting parameter(s) (summary.json lists all)")
    values = [v for *_, ys in curves + params for v in ys] + ([tol] if tol > 0 else [])
    zero = _zero_floor(values)
    for i, (name, xs, ys) in enumerate(curves):
        _log_series(ax, xs, ys, zero, color=colors[name], label=f"{name}: max over parameters",
                    style=_style(1 + i % 2))
    for i, (label, xs, ys) in enumerate(params):
        _log_series(ax, xs, ys, zero, color=_CYCLE[i % len(_CYCLE)], label=label,
                    style={"lw": 1.0, "ls": "-", "alpha": 0.8})
    if tol > 0:
        ax.axhline(tol, color="red", ls="-.", lw=1.2, label=f"tolerance {tol:g}")
    _zero_line(ax, zero, extra="; tolerance 0: replicas must stay bit-identical" if tol == 0 else "")
    if not any(v > 0 for v in values):
        # only zeros: give the log axis a range around the zero line instead of a singular one
        ax.set_ylim(zero / 3, zero * 1e3)
    _log_axis(ax, zero)
    if not any(v > 0 for v in values):
        ax.yaxis.set_major_locator(ticker.FixedLocator([zero]))  # a decade scale of nothing misleads
        ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xlabel("step (drift measured after the step's update)")
    ax.set_ylabel("max |param(rank i) - param(rank j)|")
    ax.set_title(f"Replica drift of replicated parameters: {title(meta)}")
    _mark_failure(ax, gate, lambda f: f.rule == "drift")
    _legend_outside(ax)
    return fig


def _plot_gradnorm(runs, meta, gate: GateResult, colors, golden=None) -> Figure:
    fig, ax = _figure()
    pairs = gate.pairs or ()
    if not pairs:
        ax.text(0.5, 0.5, "one run only: no ratio to draw", ha="center", va="center",
                transform=ax.transAxes)
    ref = lockstep_scale(runs, "grad_norm", gate.reference)
    spans = []  # half-widths the y range must show: the ratios' and the first band's
    for i, (a, b) in enumerate(pairs):
        ga, gb = series(runs[a], "grad_norm"), series(runs[b], "grad_norm")
        steps = [s for s in sorted(set(ga) & set(gb)) if gb[s] != 0]
        xs = steps
        ys = [ga[s] / gb[s] for s in steps]
        spans += [abs(y - 1) for y in ys if math.isfinite(y)]
        ax.plot(xs, ys, color=colors[a] if b == gate.reference else _pair_color(i),
                label=f"grad_norm[{a}] / grad_norm[{b}]", **_style(i), **_markers(xs))
        if i == 0 and "grad_norm" in gate.bands.lockstep_metrics and steps:
            # the gate bounds |ga - gb|, which is this band on the ratio
            half = [gate.bands.tight(gate.dtype, ref.get(s, gb[s]), s) / abs(gb[s]) for s in steps]
            spans.append(half[0])
            ax.fill_between(steps, [1 - h for h in half], [1 + h for h in half], color="green",
                            alpha=0.15, label=f"gate band for {a}/{b}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    # the band widens as the grad norm falls below 1; scale to the data, not to the band's end
    width = 1.4 * max(spans, default=0.0) or 1e-6
    ax.set_ylim(1 - width, 1 + width)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.set_xlabel("step")
    ax.set_ylabel("grad-norm ratio (1 = identical)")
    ax.set_title(f"Gradient norm ratio: {title(meta)}")
    _mark_failure(ax, gate, lambda f: f.metric == "grad_norm")
    if pairs:
        _legend_outside(ax)
    return fig


def _plot_schedule(runs, meta, gate: GateResult, colors, golden=None) -> Figure:
    fig = Figure(figsize=(11, 6), layout="constrained")
    ax_lr, ax_tps = fig.subplots(2, 1, sharex=True)
    for i, (name, recs) in enumerate(runs.items()):
        xs, ys = _xy(series(recs, "lr"))
        ax_lr.plot(xs, ys, color=colors[name], label=name, **_style(i))
        xs, ys = _xy({s: v for s, v in series(recs, "tokens_per_s").items() if math.isfinite(v)})
        ax_tps.plot(xs, ys, color=colors[name], label=name, **_style(i), **_markers(xs))
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title(f"Schedule and throughput: {title(meta)}")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step")
    if runs:
        ax_lr.legend(loc="upper right", fontsize=8)
    return fig


def _figure() -> tuple[Figure, Any]:
    fig = Figure(figsize=(11, 5), layout="constrained")
    return fig, fig.subplots()


def _legend_outside(ax) -> None:
    # curves fill the whole log range; a legend inside would hide some of them
    if not ax.get_legend_handles_labels()[0]:
        return
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)


def _colors(runs: Mapping[str, Any]) -> dict[str, str]:
    out, extra = {}, iter(_CYCLE * (1 + len(runs) // len(_CYCLE)))
    for name in runs:
        out[name] = _COLORS.get(name) or next(extra)
    return out


def _pair_color(i: int) -> str:
    return ("tab:red", "tab:purple", "tab:green", "tab:brown")[i % 4]


def _style(i: int) -> dict[str, Any]:
    return dict(_STYLES[i % len(_STYLES)])


def _markers(xs: Sequence[int]) -> dict[str, Any]:
    return {"marker": "o", "ms": 3} if len(xs) <= 60 else {}


def _xy(values: Mapping[int, float]) -> tuple[list[int], list[float]]:
    steps = sorted(values)
    return steps, [values[s] for s in steps]


def _zero_floor(values: Sequence[float]) -> float:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return 1e-16
    # two decades under the smallest real value: clearly apart, without squashing the rest
    return 10 ** (math.floor(math.log10(min(positive))) - 2)


def _log_series(ax, xs, ys, zero, *, color, label, style) -> None:
    shown = [y if y > 0 else zero for y in ys]  # NaN stays NaN: a gap in the line
    ax.plot(xs, shown, color=color, label=label, **style)
    zx = [x for x, y in zip(xs, ys, strict=True) if y == 0]
    if zx:
        ax.plot(zx, [zero] * len(zx), ls="none", marker="o", ms=5, mfc="none", color=color)
    nx = [x for x, y in zip(xs, ys, strict=True) if not math.isfinite(y)]
    for x in nx:
        ax.axvline(x, color=color, ls=":", lw=1)


def _zero_line(ax, zero: float, extra: str = "") -> None:
    """Dotted line at the stand-in for 0; its tick reads "0" so it is never taken for 10^-k.
    The tick formatter that makes it read "0" is installed by `_log_axis`."""
    ax.axhline(zero, color="gray", ls=":", lw=1)
    ax.annotate("0 (bit-identical)" + extra, xy=(0.99, zero), xycoords=("axes fraction", "data"),
                xytext=(0, 5), textcoords="offset points", fontsize=8, color="dimgray", ha="right",
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})


def _log_axis(ax, zero: float) -> None:
    ax.set_yscale("log")
    base = ticker.LogFormatterSciNotation()

    def fmt(y, pos=None):
        # nothing real is plotted below the zero line, so neither are ticks
        if y < zero * 0.999:
            return ""
        return "0" if abs(math.log10(y) - math.log10(zero)) < 1e-6 else base(y, pos)

    ax.yaxis.set_major_formatter(ticker.FuncFormatter(fmt))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    if ax.get_ylim()[0] < zero / 10:
        ax.set_ylim(bottom=zero / 3)


def _mark_failure(ax, gate: GateResult, mine=None) -> None:
    """Solid red line at the run's first failure; dashed at this plot's own first failure
    (`mine` selects the failures the plot shows) when that comes later."""
    first = gate.first_failure
    if first is None:
        return
    _failure_line(ax, first, "first failure", "-", 0.5)
    own = next((f for f in gate.failures if mine is not None and mine(f)), None)
    if own is not None and own.step != first.step:
        _failure_line(ax, own, f"first {own.metric} failure here", "--", 0.2)


def _failure_line(ax, f, label: str, ls: str, y: float) -> None:
    ax.axvline(f.step, color="red", lw=1.5, ls=ls)
    what = f"{f.rule} {f.metric}, {f.run}" + (f" vs {f.other}" if f.other else "")
    if f.param:
        what += f"\n{f.param}"
    ax.annotate(f"{label}: step {f.step}\n{what}", xy=(f.step, y),
                xycoords=("data", "axes fraction"), xytext=(6, 0), textcoords="offset points",
                color="red", fontsize=8, va="center",
                bbox={"boxstyle": "round", "fc": "white", "ec": "red", "alpha": 0.85})


def title(meta: Mapping[str, Any]) -> str:
    parts = [str(meta.get("case", "?")), str(meta.get("dtype", "?"))]
    if "world_size" in meta:
        parts.append(f"ws={meta['world_size']} (dp={meta.get('dp', '?')} tp={meta.get('tp', '?')})")
    if meta.get("optimizer"):
        parts.append(str(meta["optimizer"]))
    return ", ".join(parts)


MAKERS = {"loss": _plot_loss, "lockstep": _plot_lockstep, "drift": _plot_drift, "gradnorm": _plot_gradnorm,
          "schedule": _plot_schedule}
"""Plot name -> maker; PLOTS is the order they are written and shown."""

def floor_label(meta) -> str:
    # runs recorded before cases declared their training all trained on the Markov chain
    return str(meta.get("floor_label") or "entropy rate")
