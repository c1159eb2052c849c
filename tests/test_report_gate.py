"""Records -> gate -> golden -> report on synthetic step records (no torch.distributed)."""

import base64
import json
import math

import pytest

from sp_harness.judge.gate import EPS, FAIL, PASS, GateBands, default_pairs, evaluate
from sp_harness.judge.golden import compare_to_golden, load_golden, make_golden, save_golden
from sp_harness.record.records import (
    StepRecord,
    make_meta,
    read_meta,
    read_records,
    read_run_dir,
    write_meta,
    write_records,
    write_run_dir,
)
from sp_harness.report.html import report_from_dir, write_report

LR = 1e-2
NUM_STEPS = 12
REPLICATED = ("blocks.0.norm1.weight", "blocks.0.norm1.bias", "norm_f.weight")
FLOOR = 2.3876456700591193


def _loss(step: int) -> float:
    return FLOOR + 2.0 * math.exp(-step / 4)


def _noise(step: int, salt: int) -> float:
    # deterministic +-1e-7 relative wiggle: what reordered float32 reductions look like
    return ((step * 7919 + salt * 104729) % 13 - 6) / 6 * 1e-7


def make_runs(*, broken: bool = False, num_steps: int = NUM_STEPS) -> dict[str, list[StepRecord]]:
    runs = {}
    for salt, name in enumerate(("ref", "tp", "sp")):
        recs = []
        for s in range(num_steps):
            loss = _loss(s) * (1 + (_noise(s, salt) if name != "ref" else 0.0))
            drift = {} if name == "ref" else dict.fromkeys(REPLICATED, 0.0)
            if broken and name == "sp":
                # norm grads not summed across SP ranks: each rank's Adam step on the norm
                # weights has its own sign, so the copies are 2*lr apart after the first update
                if s >= 1:
                    drift["blocks.0.norm1.weight"] = 2 * LR
                    drift["norm_f.weight"] = LR
                if s == 2:
                    loss = _loss(s) + 1e-5
                elif s > 2:
                    loss = _loss(s) + 1e-3
            recs.append(
                StepRecord(
                    run=name,
                    step=s,
                    loss=loss,
                    grad_norm=1.5 * math.exp(-s / 8) * (1 + (_noise(s, salt + 3) if name != "ref" else 0)),
                    lr=LR,
                    replica_drift=drift,
                    max_replica_drift=max(drift.values(), default=0.0),
                    param_err_vs_ref=None if name == "ref" else 1e-7 * s,
                    step_time_s=0.01 + 0.001 * salt,
                    tokens_per_s=6400.0 / (1 + salt),
                )
            )
        runs[name] = recs
    return runs


def meta(dtype="float32"):
    return make_meta(
        case="synthetic",
        config={"hidden": 32, "lr": LR, "seq_len": 32},
        world_size=2,
        dp=1,
        tp=2,
        optimizer="adamw",
        dtype=dtype,
        floor=FLOOR,
        runs=["ref", "tp", "sp"],
    )


# ------------------------------------------------------------------------------- records


def test_records_round_trip_full_precision_and_nonfinite(tmp_path):
    recs = make_runs()["sp"][:3]
    recs[1].loss = math.nan
    recs[2].grad_norm = math.inf
    recs[2].replica_drift["norm_f.weight"] = -math.inf  # not physical; exercises the encoding
    recs[0].loss = 0.1 + 0.2  # 0.30000000000000004: repr keeps every bit
    path = write_records(tmp_path / "sp.jsonl", recs)
    for line in path.read_text().splitlines():
        # strict JSON: no NaN/Infinity tokens anywhere
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = read_records(path)
    assert back[0].loss == 0.1 + 0.2
    assert math.isnan(back[1].loss) and back[2].grad_norm == math.inf
    assert back[2].replica_drift["norm_f.weight"] == -math.inf
    assert [r.step for r in back] == [0, 1, 2]
    assert back[0] == recs[0]


def test_run_dir_and_meta_round_trip(tmp_path):
    runs = make_runs()
    write_run_dir(tmp_path, runs, meta())
    back, m = read_run_dir(tmp_path)
    assert list(back) == ["ref", "tp", "sp"] and back == runs
    assert m["floor"] == FLOOR and m["tp"] == 2 and m["runs"] == ["ref", "tp", "sp"]
    write_meta(tmp_path / "m.json", {**m, "floor": math.nan})
    assert math.isnan(read_meta(tmp_path / "m.json")["floor"])


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"step": -1}, "step must be >= 0, got -1"),
        ({"loss": "high"}, "loss must be a real number, got 'high'"),
        ({"replica_drift": {"w": 0.5}, "max_replica_drift": 0.0}, "max_replica_drift=0.0 is below .* 0.5"),
    ],
)
def test_bad_records_name_the_values(changes, match):
    fields = dict(run="sp", step=0, loss=1.0, grad_norm=1.0, lr=LR) | changes
    with pytest.raises(ValueError, match=match):
        StepRecord(**fields)


def test_read_records_names_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"run": "sp", "step": 0, "loss": 1, "grad_norm": 1, "lr": 0.1}\n{"run": "sp", "bogus": 1}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: .*unknown StepRecord fields \['bogus'\]"):
        read_records(path)


# ----------------------------------------------------------------------------------- gate


def test_band_is_derived_from_dtype():
    bands = GateBands()
    assert bands.tight("float32", 4.0, 0) == pytest.approx(64 * 2**-23 * 4.0)  # ~3.05e-5
    assert bands.tight("float64", 4.0, 0) == pytest.approx(64 * 2**-52 * 4.0)  # ~5.7e-14
    assert bands.tight("float32", 0.01, 0) == bands.tight("float32", 1.0, 0)  # max(1, |L|)
    assert bands.tight("float32", 4.0, 300) == pytest.approx(2 * bands.tight("float32", 4.0, 0))
    assert EPS["bfloat16"] == 2**-7
    with pytest.raises(ValueError, match="dtype must be one of"):
        bands.tight("float8", 1.0, 0)
    with pytest.raises(ValueError, match="lockstep_k must be finite and > 0, got -1"):
        GateBands(lockstep_k=-1)


def test_default_pairs():
    assert default_pairs(["ref", "tp", "sp"]) == (("sp", "tp"), ("sp", "ref"), ("tp", "ref"))
    assert default_pairs(["a", "b"], reference=None) == (("b", "a"),)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_correct_runs_pass(dtype):
    runs = make_runs()
    if dtype == "float64":  # float64 reorderings are ~1e-16 relative, not 1e-7
        for recs in runs.values():
            for r in recs:
                r.loss, r.grad_norm = _loss(r.step), 1.5 * math.exp(-r.step / 8)
    gate = evaluate(runs, dtype=dtype)
    assert gate.verdict == PASS and gate.passed, gate.reasons
    assert gate.reasons == [] and gate.first_failing_step is None
    assert gate.checked["lockstep"] == 3 * 2 * NUM_STEPS  # 3 pairs x (loss, grad_norm)
    assert gate.checked["drift"] == 3 * NUM_STEPS


def test_float32_noise_fails_a_float64_gate():
    # the band is a dtype property: float32-level differences are a bug in a float64 run
    gate = evaluate(make_runs(), dtype="float64")
    assert gate.verdict == FAIL and gate.first_failure.rule == "lockstep"


def test_broken_sp_fails_at_first_update_naming_the_parameter():
    gate = evaluate(make_runs(broken=True), dtype="float32")
    assert gate.verdict == FAIL
    assert gate.first_failing_step == 1 <= 2
    assert gate.first_failing_metric == "max_replica_drift"
    assert gate.first_failing_run == "sp"
    assert gate.first_failing_param == "blocks.0.norm1.weight"  # largest drift first
    first = gate.first_failure
    assert first.value == 2 * LR and first.band == 0.0
    assert first.params == ("blocks.0.norm1.weight", "norm_f.weight")
    assert first.num_failing_steps == NUM_STEPS - 1
    reason = gate.reasons[0]
    assert "sp" in reason and "blocks.0.norm1.weight" in reason and "step 1" in reason and "0.02" in reason
    # the loss departs too; lockstep names the pair, the step and both numbers
    lock = [f for f in gate.failures if f.rule == "lockstep" and f.metric == "loss"]
    assert {(f.run, f.other) for f in lock} == {("sp", "tp"), ("sp", "ref")}
    assert all(f.step == 3 for f in lock)  # 1e-5 at step 2 is inside 64 eps32 * L = 3.6e-5
    assert any("exceeds band" in r and "sp vs ref" in r for r in gate.reasons)
    assert json.loads(json.dumps(gate.to_json()))["first_failing_param"] == "blocks.0.norm1.weight"


def test_tighter_band_catches_the_loss_at_step_2():
    gate = evaluate(make_runs(broken=True), dtype="float32", bands=GateBands(lockstep_k=16))
    lock = [f for f in gate.failures if f.rule == "lockstep" and f.metric == "loss"]
    assert min(f.step for f in lock) == 2


def test_without_a_reference_run_every_pair_is_compared():
    import dataclasses

    runs = {n: [dataclasses.replace(r, run=n) for r in recs] for n, recs in zip("abc", make_runs().values(), strict=True)}
    gate = evaluate(runs, dtype="float32", reference=None)
    assert gate.passed and gate.reference is None
    assert gate.pairs == (("c", "b"), ("c", "a"), ("b", "a"))
    runs["c"][5].loss += 1e-4
    gate = evaluate(runs, dtype="float32", reference=None)
    assert {(f.run, f.other, f.step) for f in gate.failures} == {("c", "b", 5), ("c", "a", 5)}


def test_nan_drift_nan_loss_and_missing_steps_fail():
    runs = make_runs()
    runs["tp"][4].max_replica_drift = math.nan
    runs["tp"][4].replica_drift["norm_f.weight"] = math.nan
    runs["ref"][6].loss = math.nan
    del runs["sp"][9:]
    gate = evaluate(runs, dtype="float32")
    rules = {(f.rule, f.run, f.step) for f in gate.failures}
    assert ("drift", "tp", 4) in rules
    assert ("nonfinite", "ref", 6) in rules
    assert ("steps", "sp", 9) in rules
    drift = next(f for f in gate.failures if f.rule == "drift")
    assert drift.param == "norm_f.weight"
    assert any("recorded 9 of the 12 steps" in r for r in gate.reasons)


# --------------------------------------------------------------------------------- golden


def test_golden_round_trip(tmp_path):
    repeats = [make_runs()["ref"] for _ in range(3)]
    golden = make_golden(repeats, metrics=("loss", "grad_norm"), interval=1, meta={"dtype": "float32"})
    path = save_golden(tmp_path / "golden.json", golden)
    loaded = load_golden(path)
    assert loaded == golden
    entry = loaded["metrics"]["loss"]
    assert (entry["start_step"], entry["end_step"], entry["step_interval"]) == (0, NUM_STEPS - 1, 1)
    assert entry["spread"] == [0.0] * NUM_STEPS  # deterministic repeats: the tight band applies
    assert entry["values"] == [r.loss for r in repeats[0]]  # stored exactly, not re-averaged

    runs = make_runs()
    for name in runs:
        assert compare_to_golden(runs[name], loaded) == []
    shifted = [StepRecord(**{**r.__dict__, "loss": r.loss + 1e-3 * (r.step >= 5)}) for r in runs["sp"]]
    fails = compare_to_golden(shifted, loaded)
    assert [(f.metric, f.step, f.num_failing_steps) for f in fails] == [("loss", 5, NUM_STEPS - 5)]
    gate = evaluate({**runs, "sp": shifted}, dtype="float32", golden=loaded, golden_runs=["sp"])
    assert any(f.rule == "golden" and f.run == "sp" for f in gate.failures)


def test_golden_band_comes_from_spread_when_runs_are_noisy():
    base = make_runs()["ref"]
    noisy = [
        [StepRecord(**{**r.__dict__, "loss": r.loss + k * 1e-3}) for r in base] for k in (-1, 0, 1)
    ]
    # a bf16-autocast run reduces its loss in float32: that is the dtype of the tight band
    golden = make_golden(noisy, metrics=("loss",), interval=2, meta={"dtype": "float32"})
    entry = golden["metrics"]["loss"]
    assert entry["step_interval"] == 2 and len(entry["values"]) == NUM_STEPS // 2
    assert entry["spread"][0] == pytest.approx(2e-3)
    # band = 2 * spread = 4e-3 around the mean, far wider than the float32 tight band (~4e-5)
    ok = [StepRecord(**{**r.__dict__, "loss": r.loss + 3e-3}) for r in base]
    assert compare_to_golden(ok, golden) == []
    bad = [StepRecord(**{**r.__dict__, "loss": r.loss + 5e-3}) for r in base]
    (fail,) = compare_to_golden(bad, golden)
    assert (fail.rule, fail.step, fail.num_failing_steps) == ("golden", 0, NUM_STEPS // 2)
    assert fail.band == pytest.approx(4e-3)


def test_golden_rejects_mismatched_repeats():
    runs = make_runs()
    with pytest.raises(ValueError, match="repeat 1 covers 5 steps"):
        make_golden([runs["ref"], runs["tp"][:5]])


# --------------------------------------------------------------------------------- report


def _check_common(out_dir, runs, verdict):
    for name in ("loss", "lockstep", "drift", "gradnorm", "schedule"):
        assert (out_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out_dir / "report.html").read_text()
    assert text.count("data:image/png;base64,") == 5
    assert "src='http" not in text and "<link" not in text and "<script" not in text  # self-contained
    start = text.index("data:image/png;base64,") + len("data:image/png;base64,")
    assert base64.b64decode(text[start : text.index("'", start)])[:4] == b"\x89PNG"
    assert f"class='verdict {verdict}'>{verdict}</div>" in text
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["verdict"] == verdict
    assert set(summary["runs"]) == {"ref", "tp", "sp"}
    sp = summary["runs"]["sp"]
    assert sp["final_distance_to_floor"] == pytest.approx(runs["sp"][-1].loss - FLOOR)
    md = (out_dir / "summary.md").read_text()
    assert verdict in md and "| sp |" in md
    return text, summary, md


def test_report_of_correct_runs(tmp_path):
    runs = make_runs()
    golden = make_golden([runs["ref"]], meta={"dtype": "float32"})
    gate = evaluate(runs, dtype="float32", golden=golden)
    assert gate.passed and gate.checked["golden"] == 3
    html_path = write_report(tmp_path, runs, meta(), gate, golden=golden)
    assert html_path == tmp_path / "report.html"
    text, summary, _ = _check_common(tmp_path, runs, "PASS")
    assert summary["reasons"] == [] and summary["first_failing_step"] is None
    assert summary["runs"]["sp"]["max_replica_drift"] == 0.0
    assert "0 (bit-identical)" in text


def test_report_from_dir_of_broken_sp(tmp_path, monkeypatch):
    from sp_harness.report import html

    runs = make_runs(broken=True)
    write_run_dir(tmp_path / "run", runs, meta())
    # the plots alone (write_plots, which the report calls first): what it returns and that it
    # writes those PNGs and nothing else (rendered once here, not again for a test of its own)
    plotted = []

    def spy(out_dir, *args, **kwargs):
        before = set(out_dir.iterdir())
        pngs = write_plots(out_dir, *args, **kwargs)
        plotted.append((pngs, set(out_dir.iterdir()) - before))
        return pngs

    write_plots = html.write_plots
    monkeypatch.setattr(html, "write_plots", spy)
    gate, html_path = report_from_dir(tmp_path / "run")
    assert gate.verdict == FAIL and html_path == tmp_path / "run" / "report.html"
    ((pngs, written),) = plotted
    assert sorted(p.name for p in pngs.values()) == ["drift.png", "gradnorm.png", "lockstep.png", "loss.png",
                                                     "schedule.png"]
    assert sorted(p.name for p in written) == sorted(p.name for p in pngs.values())
    text, summary, md = _check_common(tmp_path / "run", runs, "FAIL")
    assert summary["first_failing_step"] == 1
    assert summary["first_failing_param"] == "blocks.0.norm1.weight"
    assert summary["first_failing_metric"] == "max_replica_drift"
    assert summary["reasons"] == gate.reasons
    assert "blocks.0.norm1.weight" in text and "blocks.0.norm1.weight" in md


def test_drift_legend_names_every_drifting_param_up_to_its_limit_and_counts_the_rest():
    # issue 21: a legend that named 3 of 4 drifting params hid the fourth
    from sp_harness.report import plots

    runs = make_runs(broken=True)
    gate = evaluate(runs, dtype="float32")
    drift = next(f for f in gate.failures if f.rule == "drift")
    fig = plots._plot_drift(runs, meta(), gate, plots._colors(runs))
    labels = fig.axes[0].get_legend_handles_labels()[1]
    for p in drift.params[:plots.MAX_DRIFT_PARAMS]:
        assert any(p in label for label in labels), (p, labels)
    hidden = len(drift.params) - plots.MAX_DRIFT_PARAMS
    assert (hidden > 0) == any("more drifting parameter" in label for label in labels)
