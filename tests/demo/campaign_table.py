"""Summarise false-alarm campaign records (the JSONL that tests/demo/false_alarms.py --out writes).

Per dtype: draws, false alarms, draws at a training-like size (hidden >= 256 and seq_len >= 256),
draws per case and kernel family, the worst PASS ratio per check with its repro, and the tensors
not judged because their bounds would pass a zero tensor (tolerance.vacuous). Draws that
ran no sequence parallelism (world_size / dp = 1) are left out unless --with-sp1: they exercise
the tolerance model on an unsharded run, not an SP implementation.

    python tests/demo/campaign_table.py RECORDS.jsonl [...] [--with-sp1]

A file's kernel family is the leading word of its name (native-*.jsonl, avx2-*.jsonl, default-*.jsonl).

A draw whose checks never ran (a verdict other than the expected one with no check ratios: a rank
killed by a signal, the out-of-memory killer's SIGKILL among them, or one that raised) is no
verdict of the tolerance model: it is counted and named apart, as a crash, and left out of the
draws and false alarms.
"""

import argparse
import collections
import json
from pathlib import Path

FAMILIES = ("native", "avx2", "default")
ZERO_SIZE = 1e8
"""A withheld piece whose bound is this many times its float64 value or more is zero in exact
arithmetic: the 9,405 vacuous sizes of the eighteenth to twentieth sessions' bfloat16 campaign
fall at most 2,925 or at least 2.2e14 (every one of the latter an attention's k-proj bias grad)."""

parser = argparse.ArgumentParser()
parser.add_argument("records", nargs="+")
parser.add_argument("--with-sp1", action="store_true", help="also count draws with one rank per replica")
args = parser.parse_args()

rows = []
for path in args.records:
    family = Path(path).name.split("-")[0].split(".")[0]
    for line in open(path):
        record = json.loads(line)
        record["family"] = family
        rows.append(record)
left_out = [r for r in rows if r["world_size"] // r["dp"] < 2]
if not args.with_sp1:
    rows = [r for r in rows if r["world_size"] // r["dp"] >= 2]
    print(f"({len(left_out)} draws with one rank per replica left out)")
crashed = [r for r in rows if r["verdict"] != r["expected"] and not r.get("worst")]
rows = [r for r in rows if r["verdict"] == r["expected"] or r.get("worst")]
for dtype in sorted({r["dtype"] for r in rows}):
    draws = [r for r in rows if r["dtype"] == dtype]
    alarms = [r for r in draws if r["verdict"] != r["expected"]]
    training = sum(1 for r in draws if r["hidden"] >= 256 and r["seq_len"] >= 256)
    print(f"{dtype}: {len(draws)} draws, {len(alarms)} false alarms, {training} at a training-like size")
    per = collections.Counter((r["case"], r["family"]) for r in draws)
    for case in sorted({r["case"] for r in draws}):
        print(f"  {case}: " + ", ".join(f"{f} {per[(case, f)]}" for f in FAMILIES if per[(case, f)]))
    passed = [r for r in draws if r["verdict"] == "PASS"]
    for kind in sorted({k for r in passed for k in r["worst"]}):
        worst = max(passed, key=lambda r, k=kind: r["worst"].get(k, 0.0))
        print(f"  worst {kind}: {worst['worst'][kind]:.3f} ({worst['family']}) {worst['repro']}")
    judged = [r for r in passed if r.get("forward_scale")]
    if judged:
        worst = max(judged, key=lambda r: r["forward_scale"])
        print(f"  forward scale judged in {len(judged)}, worst {worst['forward_scale']:.3f}")
    recorded = [r for r in passed if r.get("worst_scale")]
    if recorded:
        worst = max(recorded, key=lambda r: r["worst_scale"]["ratio"])
        print(f"  grad scale (recorded) worst {worst['worst_scale']['ratio']:.3f} ({worst['worst_scale']['name']}) "
              f"{worst['repro']}")
    withheld = [r for r in draws if r.get("vacuous")]
    if withheld:
        kinds = collections.Counter(v["kind"] for r in withheld for v in r["vacuous"])
        weights = sum(1 for r in withheld for v in r["vacuous"] if not v["name"].endswith("bias"))
        print(f"  vacuous (not judged): {len(withheld)} draws, {sum(kinds.values())} tensors "
              f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}; {weights} not a bias)")
        # records since the would-be ratio was recorded: what judging them would have said, split at
        # ZERO_SIZE between pieces zero in exact arithmetic (bounds ~1e14x their float64 value) and the rest
        for label, keep in (("zero in exact arithmetic", lambda v: v["bound"] >= ZERO_SIZE),
                            ("with digits", lambda v: v["bound"] < ZERO_SIZE)):
            seen = [(v["withheld_ratio"], v["name"], r["repro"]) for r in withheld for v in r["vacuous"]
                    if "withheld_ratio" in v and keep(v)]
            if seen:
                ratio, name, repro = max(seen)
                print(f"    would-be ratio, {label}: {len(seen)} tensors, {sum(x[0] > 1 for x in seen)} above 1, "
                      f"worst {ratio:.3g} ({name}) {repro}")
    for r in alarms:
        print(f"  FALSE ALARM ({r['family']}, {r['verdict']}): {r['repro']}")
if crashed:
    print(f"{len(crashed)} draws crashed before any check ran (not counted above):")
    for r in crashed:
        print(f"  CRASHED ({r['family']}): {r.get('reason', '')[:300]} :: {r['repro']}")
