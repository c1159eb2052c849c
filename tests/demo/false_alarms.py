"""Measure the tolerance model's false-alarm rate: draw configs from harness.strategies for the
correct cases, run each check, count verdicts that differ from harness.expect. Progress lines are
flushed as it goes. Usage: python tests/demo/false_alarms.py CASE N"""

import sys
import time

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from harness.expect import expected_verdict
from harness.strategies import gpt_configs, mlp_configs
from harness.verify import check, default_manager

case, total = sys.argv[1], int(sys.argv[2])
if case == "seed-mlp":
    strategy = mlp_configs(max_world_size=4)
elif case == "dtensor-gpt":
    strategy = gpt_configs(case, max_world_size=4, max_dp=1, chunk_only=True)
elif case == "megatron-gpt-ref":
    strategy = st.builds(lambda c, dp: c.replace(world_size=dp, dp=dp, seq_shards=None),
                         gpt_configs(case, max_world_size=1), st.integers(1, 2))
else:
    strategy = gpt_configs(case, max_world_size=4)
stats = {"n": 0, "false_alarms": 0, "verdicts": {}}
t0 = time.perf_counter()


@settings(max_examples=total, database=None, deadline=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(config=strategy)
def run(config):
    res = check(config, default_manager())
    stats["n"] += 1
    stats["verdicts"][res.verdict] = stats["verdicts"].get(res.verdict, 0) + 1
    if res.verdict != expected_verdict(config):
        stats["false_alarms"] += 1
        print(f"MISMATCH {res.verdict} vs {expected_verdict(config)}: {res.config.repro()} :: {res.reason[:200]}", flush=True)
    if stats["n"] % 25 == 0:
        el = time.perf_counter() - t0
        print(f"{case}: {stats['n']} examples, {stats['false_alarms']} mismatches, {el:.0f}s, {stats['n'] / el:.2f} ex/s, "
              f"{stats['verdicts']}", flush=True)


run()
el = time.perf_counter() - t0
print(f"DONE {case}: {stats['n']} examples, {stats['false_alarms']} mismatches, {el:.0f}s, {stats['n'] / el:.2f} ex/s, "
      f"{stats['verdicts']}", flush=True)
