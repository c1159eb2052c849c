"""The benchmark's bare-compute job runs the same models as a check, without capture or compare."""

from sp_harness.config.check_config import CheckConfig


def test_bare_rank_runs_the_case_without_capture(sp_pool):
    config = CheckConfig(case="megatron-gpt-sp", world_size=2, seq_len=10)
    rows = sp_pool.run(2, "sp_harness.suites.bench:bare_rank", config, timeout_s=60, label="bare megatron-gpt-sp")
    assert len(rows) == 2 and all(r["total_s"] > 0 for r in rows)
