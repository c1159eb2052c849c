"""The benchmark's bare-compute job runs the same models as a check, without capture or compare;
`sp-harness bench --quick` runs to completion (the full tier)."""

import json
import subprocess
import sys

import pytest

from sp_harness.config.check_config import CheckConfig
from sp_harness.suites.bench_bare import bare_rank


def test_bare_rank_runs_the_case_without_capture(sp_pool):
    config = CheckConfig(case="megatron-gpt-sp", world_size=2, seq_len=10)
    rows = sp_pool.run(2, bare_rank, config, timeout_s=60, label="bare megatron-gpt-sp")
    assert len(rows) == 2 and all(r["total_s"] > 0 for r in rows)


def test_profile_splits_a_check_by_stage_and_the_perturbed_reference_by_part(sp_pool):
    from sp_harness.suites.bench_profile import ALT_PARTS, format_profile, run_profile
    from sp_harness.suites.bench_realistic import realistic_config, runnable

    config = runnable(realistic_config("megatron-gpt-sp", 2, 128, 16)).replace(steps=1)
    p = run_profile(config, sp_pool)
    ranks = p["ranks"]
    assert len(ranks) == 2 and len(p["bare_rank_s"]) == 2
    owners = [r for r in ranks if "alt" in r["seconds"]]
    assert len(owners) == 1 and owners[0]["num_noised_ops"] > 0
    assert all(k in owners[0]["seconds"] for k in ALT_PARTS)
    for r in ranks:
        # the stages and `other` add up to the rank's total (the alt parts are inside `alt`)
        for seconds, total in ((r["seconds"], r["total_s"]), (r["cpu_seconds"], r["total_cpu_s"])):
            assert abs(sum(v for k, v in seconds.items() if k not in ALT_PARTS) - total) < 1e-6 * max(1.0, total)
    text = format_profile(p)
    assert "alt: input/output noise" in text and "broadcast refs" in text


def test_every_target_is_printed_with_its_figure_and_verdict():
    from sp_harness.suites.bench_targets import Target, format_targets, targets

    r = {"spawn": {"seed-mlp@4": {"speedup": 100.0}, "megatron-gpt-sp@4": {"speedup": 60.0}},
         "overhead": {"seed-mlp@2": {"check_s": 3.0, "bare_s": 1.0}},
         "converge": {"s": 100.0, "steps": 200, "world_size": 2, "passed": True},
         "memory": [{"mode": "sp", "worst_ratio_all_ranks": 0.0}],
         "realistic": {"cost": [{"case": "megatron-gpt-sp", "world_size": 2, "hidden": 1024, "seq_len": 2048,
                                 "ratio": 2.5}],
                       "memory": [{"world_size": 2, "ratio": 1.2}], "suite_s": 400.0}}
    found = {t.name: t for t in targets(r)}
    assert not found["warm pool vs spawn-per-example, seed-mlp at 4 ranks"].met
    assert found["warm pool vs spawn-per-example, seed-mlp at 4 ranks"].factor == 2.0
    assert found["warm pool vs spawn-per-example, megatron-gpt-sp at 4 ranks"].met  # its target is 50x
    assert [t.met for t in found.values() if "hidden 1024" in t.name] == [True]  # < 3x at the big size
    assert not found["test suite, pytest -n auto"].met
    text = format_targets(r)
    assert "MISSED by 2.00x" in text and "MET" in text
    assert Target(name="x", value=3.0, limit=1.5, at_most=True).line().endswith("MISSED by 2.00x")


@pytest.mark.exhaustive("the fast tier runs its parts: the bare job (here, and a framework case's in test_deepspeed), "
                        "the profile, the targets")
def test_bench_quick_runs_to_completion_with_every_extra_installed(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "sp_harness.cli", "bench", "--quick", "--json", str(out)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    result = json.loads(out.read_text())
    plugin = result["plugin"]
    assert plugin["n"] == 3 and plugin["plugin_s"] > 0 and plugin["cli_s"] > 0
    assert "(j) a user's test file of N verified examples" in run.stdout
    cases = {row["case"] for row in result["realistic"]["cost"]}
    assert {"megatron-gpt-sp", "ds-ulysses-hf-llama"} <= cases, cases
    # runnable() keeps only configs expected to PASS: any other verdict at these sizes is a finding
    off = [(row["case"], row["world_size"], row["verdict"]) for row in result["realistic"]["cost"] if row["verdict"] != "PASS"]
    assert not off, off
