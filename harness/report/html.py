"""Stage: report. The self-contained HTML page and summaries of a run dir (plots: report/plots.py).

Input: the runs' step records, the run metadata (sp_harness.record.records) and the gate's decision
(sp_harness.judge.gate). Output, all in one directory:

  loss.png       loss curves of every run, the data's loss floor (where known) dashed;
  lockstep.png   |difference| between runs per step (log y) against the gate's band;
  drift.png      max cross-rank difference of replicated parameters per step (log y);
  gradnorm.png   grad-norm ratio between runs per step;
  report.html    one file, PNGs embedded as base64 data URIs, verdict first;
  summary.json   verdict, reasons, first failure, per-run figures (strict JSON);
  summary.md     a few lines for a CI job summary.

Plots use matplotlib's object API (Figure + savefig, rendered by Agg) and never import pyplot,
so no global backend is set, no display is needed and nothing leaks between calls.

Log axes cannot show 0, and 0 is the most important value here (bit-identical runs or
replicas). Zeros are drawn at a floor below every non-zero value, on a dotted line labelled
"0 (bit-identical)", with hollow markers, so "exactly equal" and "tiny" are never confused.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sp_harness.judge.gate import GateBands, GateResult, evaluate
from sp_harness.record.environment import describe as describe_environment
from sp_harness.record.records import StepRecord, json_safe, read_run_dir
from sp_harness.report.plots import PLOTS, floor_label, title, write_plots


def write_report(
    out_dir: str | Path,
    runs: Mapping[str, Sequence[StepRecord]],
    meta: Mapping[str, Any],
    gate: GateResult,
    *,
    golden: Mapping[str, Any] | None = None,
) -> Path:
    """Write the PNGs, report.html, summary.json and summary.md; return the HTML path."""
    out_dir = Path(out_dir)
    pngs = write_plots(out_dir, runs, meta, gate, golden=golden)
    figures = {name: run_figures(recs, meta.get("floor")) for name, recs in runs.items()}
    summary = _summary(meta, gate, figures, pngs)
    (out_dir / "summary.json").write_text(
        json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n", encoding="utf-8"
    )
    (out_dir / "summary.md").write_text(_markdown(meta, gate, figures), encoding="utf-8")
    html_path = out_dir / "report.html"
    html_path.write_text(_html(meta, gate, figures, pngs), encoding="utf-8")
    return html_path


def report_from_dir(
    run_dir: str | Path,
    *,
    bands: GateBands = GateBands(),
    golden: Mapping[str, Any] | None = None,
    out_dir: str | Path | None = None,
) -> tuple[GateResult, Path]:
    """Read `<run>.jsonl` + meta.json from run_dir, gate them, write the report (default: into
    run_dir). Returns (gate result, html path)."""
    runs, meta = read_run_dir(run_dir)
    gate = evaluate(runs, dtype=meta["dtype"], bands=bands, golden=golden, num_steps=meta.get("steps"))
    return gate, write_report(out_dir or run_dir, runs, meta, gate, golden=golden)


def run_figures(records: Sequence[StepRecord], floor: float | None) -> dict[str, Any]:
    """Headline numbers of one run (the report's table and summary.json's per-run entry)."""
    recs = sorted(records, key=lambda r: r.step)
    if not recs:
        return {"num_steps": 0}
    finite = [r for r in recs if math.isfinite(r.loss)]
    best = min(finite, key=lambda r: r.loss) if finite else None
    # a NaN drift is the worst drift there is; max() keeps the earliest of equal values
    drift = max(recs, key=lambda r: math.inf if math.isnan(r.max_replica_drift) else r.max_replica_drift)
    errs = [r.param_err_vs_ref for r in recs if r.param_err_vs_ref is not None]
    final = recs[-1]
    known_floor = floor if floor is not None and math.isfinite(floor) else None
    return {
        "num_steps": len(recs),
        "final_step": final.step,
        "final_loss": final.loss,
        "min_loss": best.loss if best else math.nan,
        "min_loss_step": best.step if best else None,
        "floor": floor,
        "final_distance_to_floor": final.loss - known_floor if known_floor is not None else None,
        "min_distance_to_floor": (best.loss - known_floor) if (known_floor is not None and best) else None,
        "final_grad_norm": final.grad_norm,
        "max_replica_drift": drift.max_replica_drift,
        "max_replica_drift_step": drift.step,
        "max_replica_drift_param": _argmax(drift.replica_drift),
        "max_param_err_vs_ref": max(errs) if errs else None,
        "median_tokens_per_s": _median([r.tokens_per_s for r in recs]),
        "median_step_time_s": _median([r.step_time_s for r in recs]),
    }


# --------------------------------------------------------------------------------- outputs


def header_lines(meta: Mapping[str, Any]) -> list[str]:
    """The resolved config actually run (where each field came from) and the environment, for a
    report's header; what an older meta.json does not record is left out."""
    lines = []
    config, sources = meta.get("config") or {}, meta.get("config_sources") or {}
    if config:
        shown = [f"{k}={v}" + (f" ({sources[k]})" if sources.get(k) not in (None, "run", "unset") else "")
                 for k, v in config.items() if v is not None and sources.get(k) != "engine default" and k != "case"]
        lines.append("config: " + " ".join(shown))
        engine = [f"{k}={config[k]}" for k, src in sources.items() if src == "engine default" and config.get(k) is not None]
        if engine:
            lines.append("engine defaults (a case that does not read them ignores them): " + " ".join(engine))
    if meta.get("environment"):
        lines.append("ran on: " + describe_environment(meta["environment"]))
    return lines


def _summary(meta, gate: GateResult, figures, pngs) -> dict[str, Any]:
    g = gate.to_json()
    return {
        "verdict": gate.verdict,
        "reasons": gate.reasons,
        "first_failing_step": gate.first_failing_step,
        "first_failing_metric": gate.first_failing_metric,
        "first_failing_rule": g["first_failing_rule"],
        "first_failing_run": gate.first_failing_run,
        "first_failing_param": gate.first_failing_param,
        "case": meta.get("case"),
        "dtype": meta.get("dtype"),
        "floor": meta.get("floor"),
        "runs": figures,
        "gate": g,
        "meta": dict(meta),
        "files": sorted([p.name for p in pngs.values()] + ["report.html", "summary.json", "summary.md"]),
    }


def _markdown(meta, gate: GateResult, figures) -> str:
    mark = "PASS :white_check_mark:" if gate.passed else "FAIL :x:"
    lines = [f"### sp-harness convergence: **{mark}**", "", f"{title(meta)}; {_floor_text(meta)}", "",
             *[f"{line}  " for line in header_lines(meta)], ""]
    lines += ["| run | steps | final loss | min loss | final - floor | max drift | tokens/s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, f in figures.items():
        lines.append(
            f"| {name} | {f.get('num_steps', 0)} | {_num(f.get('final_loss'))} | {_num(f.get('min_loss'))} | "
            f"{_num(f.get('final_distance_to_floor'))} | {_drift_text(f)} | {_num(f.get('median_tokens_per_s'), '.0f')} |"
        )
    if not gate.passed:
        first = gate.first_failure
        if first is not None:  # a FAIL has failures
            lines += ["", f"**First failure:** step {first.step}, {first.rule} `{first.metric}` ({first.run}"
                      + (f" vs {first.other}" if first.other else "")
                      + (f", parameter `{first.param}`" if first.param else "") + ")", ""]
        lines += [f"- {r}" for r in gate.reasons]
    return "\n".join(lines) + "\n"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;max-width:1100px;color:#222}
.verdict{font-size:44px;font-weight:800;padding:14px 22px;border-radius:8px;color:#fff;display:inline-block}
.PASS{background:#1a7f37}.FAIL{background:#cf222e}
table{border-collapse:collapse;margin:10px 0 18px}td,th{border:1px solid #ccc;padding:4px 9px;font-size:14px}
th{background:#f3f3f3}td.n{text-align:right;font-family:ui-monospace,Menlo,monospace}
ol.reasons li{margin:4px 0;font-family:ui-monospace,Menlo,monospace;font-size:13px}
figure{margin:18px 0}figcaption{color:#555;font-size:13px}img{max-width:100%;border:1px solid #ddd}
pre{background:#f6f8fa;padding:8px;font-size:12px;overflow:auto}.muted{color:#666;font-size:13px}
"""

_CAPTIONS = {
    "loss": "Loss per step for every run; dashed: the data's loss floor, where the case's training data has a "
    "known one (the entropy rate of the GPT cases' Markov chain).",
    "lockstep": "Absolute difference between runs per step (log scale) against the gate's band; "
    "points on the dotted line are exactly 0.",
    "drift": "Largest cross-rank difference of any replicated parameter after each step's update "
    "(log scale); points on the dotted line are exactly 0 (bit-identical).",
    "gradnorm": "Ratio of gradient norms between runs per step; 1 means identical.",
    "schedule": "Learning rate (warmup, then cosine decay) and throughput in tokens per second per step of "
    "every run (the first step includes one-time work).",
}


def _html(meta, gate: GateResult, figures, pngs) -> str:
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'>",
           f"<title>sp-harness {e(gate.verdict)}: {e(str(meta.get('case', '')))}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<div class='verdict {gate.verdict}'>{gate.verdict}</div>",
           f"<p><b>{e(title(meta))}</b>; {e(_floor_text(meta))}</p>"]
    out += [f"<p class='meta'>{e(line)}</p>" for line in header_lines(meta)]
    out += [f"<p class='note'><b>Note:</b> {e(n)}</p>" for n in gate.notes]
    if gate.passed:
        checked = ", ".join(f"{k}: {v}" for k, v in gate.checked.items())
        out.append(f"<p>All gate rules hold. Comparisons made: {e(checked)}.</p>")
    else:
        first = gate.first_failure
        if first is not None:  # a FAIL has failures
            out.append(f"<p><b>First failure:</b> step {first.step}, {e(first.rule)} <code>{e(first.metric)}</code>, "
                       f"run {e(first.run)}" + (f" vs {e(first.other)}" if first.other else "")
                       + (f", parameter <code>{e(first.param)}</code>" if first.param else "") + "</p>")
        out.append("<h2>Reasons</h2><ol class='reasons'>")
        out += [f"<li>{e(r)}</li>" for r in gate.reasons]
        out.append("</ol>")
    out.append("<h2>Runs</h2><table><tr><th>run</th><th>steps</th><th>final loss</th><th>min loss (step)</th>"
               "<th>final &minus; floor</th><th>final grad norm</th><th>max replica drift (step, parameter)</th>"
               "<th>max |param &minus; ref|</th><th>tokens/s (median)</th><th>step time s (median)</th></tr>")
    for name, f in figures.items():
        min_loss = f"{_num(f.get('min_loss'))} ({f.get('min_loss_step')})"
        out.append(
            f"<tr><td>{e(name)}</td><td class='n'>{f.get('num_steps', 0)}</td>"
            f"<td class='n'>{_num(f.get('final_loss'))}</td><td class='n'>{e(min_loss)}</td>"
            f"<td class='n'>{_num(f.get('final_distance_to_floor'))}</td>"
            f"<td class='n'>{_num(f.get('final_grad_norm'))}</td><td class='n'>{e(_drift_text(f, True))}</td>"
            f"<td class='n'>{_num(f.get('max_param_err_vs_ref'))}</td>"
            f"<td class='n'>{_num(f.get('median_tokens_per_s'), '.0f')}</td>"
            f"<td class='n'>{_num(f.get('median_step_time_s'), '.4g')}</td></tr>"
        )
    out.append("</table>")
    out.append(f"<p class='muted'>Lockstep band: {e(gate.bands.describe(gate.dtype))}; drift tolerance "
               f"{gate.bands.drift_tolerance:g}; eps({e(gate.dtype)}) = {GateBands.eps(gate.dtype):.3e}.</p>")
    for name in PLOTS:
        if name not in pngs:
            continue
        data = base64.b64encode(pngs[name].read_bytes()).decode("ascii")
        out.append(f"<figure><img alt='{name}' src='data:image/png;base64,{data}'>"
                   f"<figcaption>{e(_CAPTIONS[name])}</figcaption></figure>")
    out.append("<h2>Metadata</h2><pre>" + e(json.dumps(json_safe(dict(meta)), indent=2)) + "</pre>")
    out.append("</body></html>\n")
    return "\n".join(out)


def _floor_text(meta) -> str:
    floor = meta.get("floor")
    if floor is None or not math.isfinite(floor):
        return "no known loss floor"
    return f"loss floor ({floor_label(meta)}) {floor:.6f}"




def _drift_text(f: Mapping[str, Any], long: bool = False) -> str:
    d = f.get("max_replica_drift")
    if d is None:
        return "n/a"
    if d == 0:
        return "0 (bit-identical)"
    text = _num(d)
    if long and f.get("max_replica_drift_param"):
        text += f" ({f.get('max_replica_drift_step')}, {f['max_replica_drift_param']})"
    return text


def _num(x: Any, fmt: str = ".6g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, fmt)


def _median(xs: Sequence[float]) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return statistics.median(finite) if finite else math.nan


def _argmax(d: Mapping[str, float]) -> str | None:
    if not d:
        return None
    return max(d, key=lambda k: math.inf if math.isnan(d[k]) else d[k])
