"""Summarise false_alarms.py JSONL records as the README's markdown tables.

    python tests/demo/fa_table.py [--rejudge] FILE.jsonl [FILE.jsonl ...]

--rejudge recomputes each record's expected verdict from its repro line with today's
sp_harness.judge.expect (after a predicate fix; the verdicts themselves are the recorded ones).

Per case: examples, false alarms (verdict != expected), verdicts, dtypes, adversary modes, kernel
families and threads, realistic-size examples (hidden >= 64 or seq >= 64), the largest sizes drawn,
examples/s, and the worst ratio per check over the PASSing examples (how close to its bound)."""

import json
import sys
from collections import Counter, defaultdict

rejudge = "--rejudge" in sys.argv
paths = [a for a in sys.argv[1:] if a != "--rejudge"]


def _expected(repro: str) -> str:
    import shlex

    from sp_harness.cli import build_parser, config_from_args
    from sp_harness.judge.expect import expected_verdict

    return expected_verdict(config_from_args(build_parser().parse_args(shlex.split(repro)[1:])))


rows = defaultdict(list)
for path in paths:
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if rejudge:
                r["expected"] = _expected(r["repro"])
            rows[r["case"]].append(r)

print("| case | examples | false alarms | verdicts | float64 / float32 / bfloat16 | reorder / reorder-tf32 "
      "| kernels (threads) | realistic (hidden or seq >= 64) | largest | examples/s |")
print("|---|---:|---:|---|---|---|---|---:|---|---:|")
worst_lines = []
for case, rs in rows.items():
    n = len(rs)
    fa = sum(r["verdict"] != r["expected"] for r in rs)
    verdicts = Counter(r["verdict"] for r in rs)
    dt = Counter(r["dtype"] for r in rs)
    adv = Counter(r["adversary"] for r in rs)
    env = Counter(f"{r['env']['ATEN_CPU_CAPABILITY'] or 'native'} ({r['env']['OMP_NUM_THREADS'] or '1'})" for r in rs)
    big = [r for r in rs if (r["hidden"] or 0) >= 64 or (r["seq_len"] or 0) >= 64]
    largest = max(rs, key=lambda r: (r["hidden"] or 0) * (r["seq_len"] or 0) * (r["num_layers"] or 1))
    secs = sum(r["seconds"] for r in rs)
    print(f"| {case} | {n} | **{fa}** | {', '.join(f'{v} {k}' for k, v in verdicts.most_common())} "
          f"| {dt['float64']} / {dt['float32']} / {dt['bfloat16']} | {adv['reorder']} / {adv['reorder-tf32']} "
          f"| {', '.join(f'{k}: {v}' for k, v in sorted(env.items()))} | {len(big)} "
          f"| hidden {largest['hidden']}, seq {largest['seq_len']}, {largest['num_layers']} layers, "
          f"{largest['steps']} steps | {n / secs:.2f} |")
    worst = defaultdict(float)
    for r in rs:
        if r["verdict"] == "PASS":
            for k, v in r["worst"].items():
                worst[k] = max(worst[k], v)
    worst_lines.append(f"| {case} | " + " | ".join(f"{worst.get(k, 0.0):.3g}" for k in
                                                      ("forward", "lse", "loss", "input_grad", "grad", "param")) + " |")
print()
print("Worst ratio to the bound over the PASSing examples (1.0 would be a false alarm):")
print()
print("| case | forward | lse | loss | input grad | grad | param |")
print("|---|---:|---:|---:|---:|---:|---:|")
print("\n".join(worst_lines))
