"""The campaign summary (tests/demo/campaign_table.py) counts only draws that ran sequence
parallelism, and names every false alarm with its repro."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(case, world_size, dp, verdict, hidden=32, seq_len=12, grad=0.3):
    return {"case": case, "verdict": verdict, "expected": "PASS", "dtype": "bfloat16", "adversary": "reorder",
            "world_size": world_size, "dp": dp, "seq_len": seq_len, "hidden": hidden,
            "repro": f"sp-harness check --case {case} --world-size {world_size} --dp {dp}",
            "worst": {"grad": grad, "forward": 0.2}, "worst_scale": None, "forward_scale": None}


def test_unsharded_draws_are_left_out_and_false_alarms_named(tmp_path):
    records = tmp_path / "native-bfloat16.jsonl"
    rows = [_record("ring-gpt", 1, 1, "PASS", grad=0.9),  # one rank: no SP, not counted
            _record("ring-gpt", 2, 2, "PASS", grad=0.8),  # two DP replicas of one rank each: no SP
            _record("ring-gpt", 2, 1, "PASS", hidden=256, seq_len=256),
            _record("usp-gpt", 4, 2, "FAIL"),
            dict(_record("ulysses-gpt", 3, 1, "FAIL"), worst={}, reason="rank 0 killed by SIGKILL")]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = os.path.join(ROOT, "tests", "demo", "campaign_table.py")
    out = subprocess.run([sys.executable, script, str(records)], capture_output=True, text=True, check=True).stdout
    assert "(2 draws with one rank per replica left out)" in out
    assert "bfloat16: 2 draws, 1 false alarms, 1 at a training-like size" in out
    assert "worst grad: 0.300 (native)" in out
    assert "FALSE ALARM (native, FAIL): sp-harness check --case usp-gpt --world-size 4 --dp 2" in out
    # a draw whose checks never ran (a killed rank) is a crash, named apart, not a false alarm
    assert "1 draws crashed before any check ran" in out
    assert "CRASHED (native): rank 0 killed by SIGKILL :: sp-harness check --case ulysses-gpt" in out
    everything = subprocess.run([sys.executable, script, str(records), "--with-sp1"], capture_output=True,
                                text=True, check=True).stdout
    assert "bfloat16: 4 draws" in everything and "worst grad: 0.900" in everything
