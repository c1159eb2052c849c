"""Stage: suites. The main job: check every case, convergence report, gate.

`sp-harness nightly` on the CPU defaults: every built-in case at even and uneven configs
against its expected verdict (PASS, UNSUPPORTED, or a pinned upstream FAIL of PyTorch's DTensor
styles), then the lockstep convergence report for the Megatron-style GPT (reference vs TP vs
TP+SP, 2 ranks) gated against its bands and the stored golden curve. Writes
reports/latest/{report.html, checks.json, checks.md, summary.json, ...}; exits 0 only if every
verdict is the expected one and the gate passes.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sp_harness.config.check_config import CheckConfig
from sp_harness.config.converge_options import ConvergeOptions
from sp_harness.config.flags import add_flags, from_args

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner

GOLDEN_DIR = Path(__file__).resolve().parent.parent.parent / "reports" / "golden"
"""Golden curves by case name (`sp-harness golden --out reports/golden/CASE.json`)."""

def nightly_examples() -> list[tuple[CheckConfig, str]]:
    """(config, why) for every example every correct case declares (`Case.examples`)."""
    from sp_harness.config.registry import all_cases

    return [(ex.config(name), ex.note) for name, case in sorted(all_cases().items())
            if "mutant" not in case.tags for ex in case.examples]


def run_checks(runner: Runner) -> list[dict]:
    from sp_harness.checks import side_by_side, train_step
    from sp_harness.judge.expect import expected_verdict
    from sp_harness.report.result_text import format_result

    rows = []
    for config, why in nightly_examples():
        expected = expected_verdict(config)
        check = train_step.check if config.train_step else side_by_side.check
        res = check(config, runner)
        rows.append({"case": config.case, "config": res.config.short(), "expected": expected, "verdict": res.verdict,
                     "ok": res.verdict == expected, "why": why, "reason": res.reason.splitlines()[0][:300] if res.reason else "",
                     "repro": res.config.repro(), "wall_s": round(res.wall_s, 2)})
        mark = "ok " if res.verdict == expected else "UNEXPECTED"
        print(f"  {mark} {res.verdict:<11} (expected {expected:<11}) {config.case:<16} {res.config.short()}  {res.wall_s:.1f}s")
        if res.verdict != expected:
            print(format_result(res))
    return rows


def checks_markdown(rows: list[dict]) -> str:
    lines = ["| case | config | expected | verdict | why |", "|---|---|---|---|---|"]
    for r in rows:
        flag = "" if r["ok"] else " :x:"
        lines.append(f"| {r['case']} | {r['config']} | {r['expected']} | {r['verdict']}{flag} | {r['why']} |")
    return "\n".join(lines)


def _append_checks_to_html(html_path: Path, rows: list[dict]) -> None:
    body = ["<h2>Case checks</h2><table><tr><th>case</th><th>config</th><th>expected</th><th>verdict</th><th>why</th><th>repro</th></tr>"]
    for r in rows:
        color = "#1a7f37" if r["ok"] else "#cf222e"
        body.append(f"<tr><td>{html.escape(r['case'])}</td><td>{html.escape(r['config'])}</td><td>{r['expected']}</td>"
                    f"<td style='color:{color};font-weight:bold'>{r['verdict']}</td><td>{html.escape(r['why'])}</td>"
                    f"<td><code>{html.escape(r['repro'])}</code></td></tr>")
    body.append("</table>")
    _append_to_html(html_path, "\n".join(body))


def _append_to_html(html_path: Path, section: str) -> None:
    """`section` added at the end of the report's body."""
    text = html_path.read_text()
    marker = "</body>"
    html_path.write_text(text.replace(marker, section + marker, 1) if marker in text else text + section)


def cmd_nightly(args) -> int:
    from sp_harness.record.outdir import open_run_dir
    from sp_harness.suites.converge import validate_options

    opts = from_args(ConvergeOptions, args)
    validate_options(opts, args.out)  # a bad --case or --out is exit 2 now, not after the checks
    with open_run_dir(args.out) as run_dir:  # this run's own directory; removed if interrupted
        return _nightly(args, opts, run_dir)


def _nightly(args, opts, run_dir) -> int:
    from sp_harness.launch.runner import runner as _runner
    from sp_harness.record.environment import run_environment
    from sp_harness.report import history
    from sp_harness.suites.converge import converge, format_gate

    t0 = time.perf_counter()
    out = run_dir.path
    runner = _runner()
    print(f"[1/2] case checks ({len(nightly_examples())} configs)")
    rows = run_checks(runner)
    stages = {"checks": time.perf_counter() - t0}
    (out / "checks.json").write_text(json.dumps(rows, indent=1))
    (out / "checks.md").write_text(checks_markdown(rows) + "\n")
    checks_ok = all(r["ok"] for r in rows)
    baseline = opts.baseline_case()
    print(f"[2/2] convergence: {args.case}{f' vs {baseline}' if baseline else ''} vs reference, "
          f"{args.world_size} ranks, {args.steps} steps")
    golden_file = GOLDEN_DIR / f"{args.case}.json"
    golden = str(golden_file) if golden_file.exists() and not args.no_golden else None
    result, html_path, runs = converge(opts, runner, out, golden=golden)
    stages["convergence"] = time.perf_counter() - t0 - stages["checks"]
    _append_checks_to_html(html_path, rows)
    ok = checks_ok and result.passed
    with open(out / "summary.md", "a") as f:
        f.write("\n### Case checks\n\n" + checks_markdown(rows) + "\n")
    # the history: this run appended, its key figures drawn against the earlier runs'
    entry = history.entry_from(case=args.case, runs=runs, rows=rows, gate=result.verdict,
                               wall_s=time.perf_counter() - t0, environment=run_environment())
    log = history.history_path(args.out)
    history.append(log, entry)
    entries = history.read(log)
    _append_history_to_html(html_path, history.plot(entries, out / "history.png"), len(entries), log)
    stages["report"] = time.perf_counter() - t0 - stages["checks"] - stages["convergence"]
    _write_stages(out, stages)
    html_path = run_dir.publish() / html_path.name
    print(format_gate(result, html_path) + (f"   (golden: {golden_file.name})" if golden else "   (no golden)"))
    print(f"nightly: {'PASS' if ok else 'FAIL'}: {sum(r['ok'] for r in rows)}/{len(rows)} checks as expected, "
          f"gate {result.verdict}, {time.perf_counter() - t0:.0f}s ({_format_stages(stages)}); "
          f"history: {len(entries)} run(s) in {log}")
    return 0 if ok else 1


def _format_stages(stages: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.0f}s" for name, seconds in stages.items())


def _write_stages(out: Path, stages: dict[str, float]) -> None:
    """Each stage's wall seconds into summary.json (`stages_s`) and summary.md."""
    summary = json.loads((out / "summary.json").read_text())
    summary["stages_s"] = {name: round(seconds, 2) for name, seconds in stages.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    with open(out / "summary.md", "a") as f:
        f.write(f"\nStages (wall): {_format_stages(stages)}.\n")


def _append_history_to_html(html_path: Path, png: Path, num_runs: int, log: Path) -> None:
    import base64

    data = base64.b64encode(png.read_bytes()).decode("ascii")
    section = (f"<h2>Nightly history</h2><figure><img alt='history' src='data:image/png;base64,{data}'>"
               f"<figcaption>This run (red) against the earlier nightly runs ({num_runs} in "
               f"{html.escape(str(log))}): final loss, the largest lockstep loss difference, wall time, "
               f"throughput; a cross marks a run whose checks or gate failed.</figcaption></figure>")
    _append_to_html(html_path, section)


def add_subcommands(sub) -> None:
    p = sub.add_parser("nightly", help="the main job: check every case, convergence report, gate")
    p.add_argument("--out", default="reports/latest", help="report directory (default reports/latest)")
    # the convergence run's flags, generated from its options (the rest keep converge's defaults)
    add_flags(p, ConvergeOptions, only=("case", "world_size", "steps"))
    p.add_argument("--no-golden", action="store_true", help="skip the golden-curve comparison")
    p.set_defaults(func=cmd_nightly)
