"""The nightly history (issue 21): each run appends one line, earlier runs are read back (a
broken or foreign line skipped), and the report draws this run against the earlier ones."""

import math

from sp_harness.record.records import StepRecord
from sp_harness.report import history


def _records(run, losses):
    return [StepRecord(run=run, step=i, loss=v, grad_norm=1.0, lr=1e-3, tokens_per_s=100.0 + i)
            for i, v in enumerate(losses)]


def test_entries_round_trip_and_the_plot_draws_every_run(tmp_path):
    log = history.history_path(tmp_path / "latest")
    assert log == tmp_path / "nightly-history.jsonl"
    rows = [{"ok": True}, {"ok": False}]
    for i in range(3):
        runs = {"ref": _records("ref", [3.0, 2.0 - i]), "sp": _records("sp", [3.0, 2.0 - i + 1e-6])}
        entry = history.entry_from(case="megatron-gpt-sp", runs=runs, rows=rows, gate="PASS", wall_s=60.0 + i,
                                   environment={"timestamp": f"2026-11-2{i}T00:00:00+00:00", "torch": "2.13.0"})
        history.append(log, entry)
    with open(log, "a") as f:
        f.write('{"schema_version": 99}\n{"truncated": \n')  # another schema; a run killed mid-write
    entries = history.read(log)
    assert [e.wall_s for e in entries] == [60.0, 61.0, 62.0]
    last = entries[-1]
    assert (last.checks_ok, last.num_checks) == (1, 2) and math.isclose(last.final_loss, 1e-6)
    assert math.isclose(last.lockstep_max_abs, 1e-6, rel_tol=1e-6) and last.tokens_per_s == 101.0
    png = history.plot(entries, tmp_path / "history.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_nightly_report_gets_the_history_section(tmp_path):
    from sp_harness.suites.nightly import _append_history_to_html

    html = tmp_path / "report.html"
    html.write_text("<html><body><p>run</p></body></html>")
    entries = [history.HistoryEntry(timestamp="2026-11-24T00:00:00+00:00", case="c", num_steps=2, checks_ok=1,
                                    num_checks=1, gate="PASS", final_loss=1.0, lockstep_max_abs=0.0, wall_s=1.0,
                                    tokens_per_s=5.0)]
    _append_history_to_html(html, history.plot(entries, tmp_path / "h.png"), 1, tmp_path / "log")
    text = html.read_text()
    assert "<h2>Nightly history</h2>" in text and text.index("Nightly history") < text.index("</body>")
