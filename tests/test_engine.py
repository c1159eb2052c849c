"""The engine end to end on real gloo ranks: verdicts for the DTensor cases at world sizes 1-4,
the public case API, and the pool's failure paths (raise, hang, desync, death)."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from processes import tagged_processes

from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import ERROR, FAIL, PASS, UNSUPPORTED
from sp_harness.launch.worker import health_check

FAULTY = os.path.join(os.path.dirname(__file__), "faulty_cases.py")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_seed_mlp_passes_on_even_splits(sp_check, world_size):
    # 32 hidden columns and 12 tokens split evenly over 1, 2, 4 ranks
    res = sp_check(CheckConfig(case="seed-mlp", world_size=world_size, steps=2))
    assert res.verdict == PASS, res.reason
    assert res.num_checks > 0 and not res.drift


def test_seed_mlp_uneven_hidden_is_the_upstream_sharding_propagation_failure(sp_check):
    # pinned upstream behaviour of torch 2.13: 32 columns over 3 ranks (11/11/10)
    res = sp_check(CheckConfig(case="seed-mlp", world_size=3))
    assert res.verdict == FAIL and res.crash_kind == "raised"
    assert {e.kind for e in res.rank_errors} == {"raised"} and len(res.rank_errors) == 3
    # raised inside DTensor's sharding propagation (where, by frame; never torch's wording)
    assert all("torch/distributed/tensor/" in e.traceback for e in res.rank_errors)


def test_seed_mlp_uneven_sequence_is_a_desync(sp_check):
    # pinned upstream behaviour: 10 tokens over 3 ranks (4/4/2) with hidden 33 (even 11/11/11);
    # DTensor.from_local assumes even shards, so the ranks all-gather different sizes (gloo then
    # aborts a rank on the mismatch): the announced collectives show it first
    res = sp_check(CheckConfig(case="seed-mlp", world_size=3, seq_len=10, hidden=33))
    assert res.verdict == FAIL and res.first_check == "crash" and res.crash_kind == "desync", res.reason
    kinds = {e.collective.kind for e in res.rank_errors if e.collective is not None}
    sizes = {e.collective.nbytes for e in res.rank_errors if e.collective is not None}
    assert kinds == {"all_gather"} and len(sizes) == 2


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.exhaustive(
    "the fast tier runs dtensor-gpt on 1 and 2 ranks (3 below), and a 4-rank pool in test_seed_mlp_passes_on_even_splits"))])
def test_dtensor_gpt_passes(sp_check, world_size):
    res = sp_check(CheckConfig(case="dtensor-gpt", world_size=world_size, steps=2))
    assert res.verdict == PASS, res.reason


def test_dtensor_gpt_uneven_heads_declared_unsupported(sp_check):
    res = sp_check(CheckConfig(case="dtensor-gpt", world_size=3))
    assert res.verdict == UNSUPPORTED
    assert "[11, 11, 10]" in res.reason and "head_dim(8)" in res.reason


def test_dtensor_gpt_uneven_sequence_fails_upstream(sp_check):
    # whole heads per rank (3 heads of 8 over 3 ranks) but 10 tokens: DTensor's Shard(1) cut
    # assumes even local shapes in from_local
    res = sp_check(CheckConfig(case="dtensor-gpt", world_size=3, hidden=24, num_heads=3, seq_len=10))
    assert res.verdict == FAIL


def test_float32_and_bfloat16_runs_judged_against_float64(sp_check):
    for dtype in ("float32", "bfloat16"):
        res = sp_check(CheckConfig(case="seed-mlp", world_size=2, dtype=dtype))
        assert res.verdict == PASS, (dtype, res.reason)
        assert res.worst["forward"].allowed > 0


def test_user_case_file_by_path(sp_check):
    res = sp_check(CheckConfig(case=f"{FAULTY}:REPLICATED", world_size=2))
    assert res.verdict == PASS, res.reason


def test_rank_that_raises_in_setup_is_an_error_named_with_its_traceback(sp_check):
    # shard() raising is a setup that could not run, not a defect of the numbers: ERROR
    res = sp_check(CheckConfig(case=f"{FAULTY}:RAISING", world_size=2, timeout_s=20))
    assert res.verdict == ERROR and not res.ok
    assert "rank 1 raised RuntimeError while setting up (shard()): boom on purpose in rank 1" in res.reason
    assert res.crash_kind == "raised" and res.first_check == "setup"
    assert [(e.rank, e.kind, e.exc_type, e.phase) for e in res.rank_errors] == [(1, "raised", "RuntimeError", "shard()")]
    assert [(e.rank, e.kind, e.exc_type) for e in res.rank_errors] == [(1, "raised", "RuntimeError")]
    assert "boom on purpose in rank 1" in res.error and "faulty_cases.py" in res.error
    assert f"{FAULTY}:RAISING" in res.reason and "ws=2" in res.reason
    # the pool is rebuilt: the next job on the same world size works
    assert sp_check(CheckConfig(case="seed-mlp", world_size=2)).verdict == PASS


def test_rank_that_raises_while_stepping_is_a_fail_naming_the_module(sp_check):
    res = sp_check(CheckConfig(case=f"{FAULTY}:RAISING_IN_FORWARD", world_size=2, timeout_s=20))
    assert res.verdict == FAIL and res.first_check == "crash", res.reason
    assert "rank 1 raised RuntimeError" in res.reason and "boom on purpose in rank 1's forward" in res.reason
    assert "while setting up" not in res.reason
    assert [(e.rank, e.phase) for e in res.rank_errors][:1] == [(1, "steps")]


def test_hanging_rank_becomes_a_timeout_naming_case_config_and_rank(sp_check):
    # 5 s: rank 0 is done or blocked on rank 1 within a second of the job (seed-mlp, 3 steps)
    res = sp_check(CheckConfig(case=f"{FAULTY}:HANGING", world_size=2, timeout_s=5))
    assert res.verdict == FAIL and res.crash_kind == "timeout" and res.first_check == "hang (timeout)"
    assert res.rank_errors[0].rank == 1 and res.rank_errors[0].kind == "timeout"
    assert "timed out after 5s" in res.reason and "rank(s) 1 did not finish" in res.reason
    assert "HANGING" in res.reason and "ws=2" in res.reason
    assert "_shard_hanging" in res.error  # the hung rank's Python stack, from faulthandler
    assert sp_check(CheckConfig(case="seed-mlp", world_size=2)).verdict == PASS


def _desynced(res):
    """(rank, kind, bytes, group) per rank of a desync report, ranks in order."""
    return sorted((e.rank, e.collective.kind, e.collective.nbytes, e.collective.group) for e in res.rank_errors
                  if e.kind == "desync" and e.collective is not None)


def test_desync_is_reported_as_desync_before_the_timeout(sp_check):
    # gloo hangs on this mismatch: with a 60 s timeout only the detection can make it "desync"
    res = sp_check(CheckConfig(case=f"{FAULTY}:DESYNC", world_size=2, timeout_s=60))
    assert res.verdict == FAIL and res.crash_kind == "desync", res.reason
    assert _desynced(res) == [(0, "all_reduce", 16, (0, 1)), (1, "all_gather", 64, (0, 1))]
    assert all(e.collective.index == 0 and e.collective.group_index == 0 for e in res.rank_errors if e.collective)
    assert "collective desync" in res.reason and "_shard_desync" in res.error  # where each rank issued it
    assert sp_check(CheckConfig(case="seed-mlp", world_size=2)).verdict == PASS


def test_same_collective_with_different_sizes_is_a_desync(sp_check):
    res = sp_check(CheckConfig(case=f"{FAULTY}:DESYNC_SIZES", world_size=2, timeout_s=60))
    assert res.verdict == FAIL and res.crash_kind == "desync", res.reason
    assert _desynced(res) == [(0, "all_reduce", 16, (0, 1)), (1, "all_reduce", 32, (0, 1))]
    assert sp_check(CheckConfig(case="seed-mlp", world_size=2)).verdict == PASS


def test_a_stall_against_an_unannounced_collective_is_a_desync(sp_check, monkeypatch):
    # found only once both ranks have stopped using the CPU (their stacks are taken then); the
    # driver looks after 0.5 s of silence instead of 2 (what it finds is the same, sooner)
    monkeypatch.setattr("sp_harness.launch.replies._STALL_S", 0.5)
    res = sp_check(CheckConfig(case=f"{FAULTY}:DESYNC_UNANNOUNCED", world_size=2, timeout_s=60))
    assert res.verdict == FAIL and res.crash_kind == "desync", res.reason
    behind = [e for e in res.rank_errors if e.kind == "desync" and e.collective is None]
    assert [e.rank for e in behind] == [1] and "barrier" in behind[0].traceback, res.error
    assert sp_check(CheckConfig(case="seed-mlp", world_size=2)).verdict == PASS


@pytest.mark.parametrize("case", ["seed-mlp", "megatron-gpt-sp"])
def test_correct_cases_are_never_a_desync(sp_check, case):
    res = sp_check(CheckConfig(case=case, world_size=2))
    assert res.verdict == PASS and res.crash_kind == "", res.reason


def test_progress_lines_come_from_the_pool_and_rank_0(sp_pool):
    from sp_harness.checks.side_by_side import check
    from sp_harness.launch.runner import WithProgress

    lines = []
    res = check(CheckConfig(case="seed-mlp", world_size=2, steps=2), WithProgress(sp_pool, lines.append))
    assert res.verdict == PASS, res.reason
    assert [ln for ln in lines if ln.startswith("step")] == ["step 1/2", "step 2/2"]


def test_rank_killed_by_a_signal_is_named_with_the_signal_and_its_python_stack(sp_check):
    # in shard(): a crash before the first step, so ERROR (its kind and stack as for any crash)
    res = sp_check(CheckConfig(case=f"{FAULTY}:SEGFAULT", world_size=2, timeout_s=20))
    assert res.verdict == ERROR and res.crash_kind == "signal" and res.first_check == "setup"
    first = res.rank_errors[0]  # the crashed rank before rank 0's secondary error
    assert (first.rank, first.kind, first.signal_name) == (1, "signal", "SIGSEGV")
    assert "faulty_cases.py" in first.traceback and "_shard_segfault" in first.traceback
    assert "rank 1 killed by SIGSEGV while setting up (shard())" in res.reason
    assert "_shard_segfault" in res.error  # the human report carries the stack too
    assert sp_check(CheckConfig(case="seed-mlp", world_size=2)).verdict == PASS


def test_unsupported_raised_on_every_rank_is_unsupported(sp_check):
    res = sp_check(CheckConfig(case=f"{FAULTY}:UNSUPPORTED_LATE", world_size=2))
    assert res.verdict == UNSUPPORTED and "before any collective" in res.reason


def test_unsupported_declared_up_front_never_starts_ranks(sp_check):
    res = sp_check(CheckConfig(case="seed-mlp", world_size=2, dp=2))
    assert res.verdict == UNSUPPORTED and "dp(2) must be 1" in res.reason


def test_pool_scratch_dir_is_removed_on_close():
    from sp_harness.launch.pool import RankPool

    pool = RankPool(2)
    try:
        assert pool.run(health_check, None, timeout_s=60, label="scratch") == [2, 2]
        scratch = pool.scratch_dir
        assert scratch and os.path.isdir(scratch)
    finally:
        pool.close()
    assert not os.path.exists(scratch) and pool.scratch_dir is None


@pytest.mark.exhaustive("the fast tier starts pools of 1 to 4 ranks in every file; this one is the machine's largest")
def test_the_largest_pool_starts():
    # the most ranks the machine runs, all connecting to the driver at once (the bench's ws=8 pool
    # once failed to start here: a rank never connected within the start-up budget)
    from sp_harness.launch.pool import RankPool
    from sp_harness.launch.runner import max_world_size

    world_size = max_world_size()
    pool = RankPool(world_size)
    try:
        assert pool.run(health_check, None, timeout_s=120, label="largest") == [
            world_size] * world_size
    finally:
        pool.close()


def test_pool_scratch_dir_is_removed_at_exit_without_close():
    script = ("from sp_harness.launch.pool import RankPool\n"
              "from sp_harness.launch.worker import health_check\n"
              "pool = RankPool(1)\n"
              "pool.run(health_check, None, timeout_s=60, label='exit')\n"
              "print(pool.scratch_dir)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    scratch = out.stdout.strip().splitlines()[-1]
    assert scratch.startswith(os.path.join(tempfile.gettempdir(), "sp-harness-stacks-"))
    assert not os.path.exists(scratch)


def test_a_sigkilled_drivers_scratch_dir_is_swept_by_the_next_pool(tmp_path):
    # a driver killed by SIGKILL (the OOM killer, pkill -9) runs no finalizer: its folder stays
    # until the next pool on the machine finds its owner lock free. A live owner's is kept.
    # (The third session's campaigns left /tmp/sp-harness-stacks-* so.)
    from sp_harness.launch.scratch import ScratchDir, sweep_orphans
    script = ("import os, signal, sys\n"
              "from sp_harness.launch.scratch import ScratchDir\n"
              "d = ScratchDir()\n"
              "print(d.path, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == -signal.SIGKILL
    orphan = out.stdout.strip()
    assert os.path.isdir(orphan) and orphan.startswith(str(tmp_path))
    live = ScratchDir(root=str(tmp_path))
    try:
        assert sweep_orphans(root=str(tmp_path)) == [orphan]
        assert not os.path.exists(orphan) and os.path.isdir(live.path)
    finally:
        live.remove()
    assert not os.path.exists(live.path)


SLOW_EXIT_PROJECT = {
    "conftest.py": """
        import time

        import pytest
        from xdist.workermanage import NodeManager

        # the controller SIGKILLs a worker still alive EXIT_TIMEOUT (10 s) after it reported
        # finished: 2 s here is the same kill, sooner (a pool closed at exit leaves its folder
        # either way; the worker's own execnet ends it with os._exit after 15 s regardless)
        NodeManager.EXIT_TIMEOUT = 2


        @pytest.hookimpl(tryfirst=True)
        def pytest_unconfigure(config):
            # a worker's teardown after it reported finished (closing four warm pools, a
            # framework's interpreter teardown) outlasting the time xdist gives it; the SIGINT
            # execnet sends itself does not cut C-level work short
            deadline = time.monotonic() + 30
            while hasattr(config, "workerinput") and time.monotonic() < deadline:
                try:
                    time.sleep(deadline - time.monotonic())
                except KeyboardInterrupt:
                    pass
        """,
    "test_warm.py": """
        import pytest

        @pytest.mark.parametrize("world_size", [1, 2])
        def test_warm_pool(world_size, sp_pool):
            from sp_harness.launch.worker import health_check

            sp_pool.get(world_size).run(health_check, None, timeout_s=60, label="warm")
        """,
}


def test_xdist_workers_close_their_pools_before_they_report_finished(tmp_path):
    # xdist SIGKILLs a worker that has not exited 10 s after reporting itself finished; pools
    # closed at exit died with it and left their folders in /tmp (two CI runs left 3 and 5)
    for name, text in SLOW_EXIT_PROJECT.items():
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip())
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    # one worker holding both pools: each worker's teardown is its own, a second adds only its start
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider",
                          "-p", "no:randomly", "test_warm.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=dict(env, TMPDIR=str(scratch)))
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("sp-harness-stacks-")]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _is_fork_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"sp_harness.launch.zygote" in f.read()
    except OSError:
        return False


def _ranks(driver: int) -> tuple[list[int], list[int]]:
    """(the driver's rank processes, its fork servers): ranks are its children, or its fork
    server's (sp_harness.launch.zygote)."""
    servers = [c for c in _children(driver) if _is_fork_server(c)]
    ranks = [c for c in _children(driver) if c not in servers] + [r for s in servers for r in _children(s)]
    return ranks, servers



def test_cli_leaves_no_process_nor_file_behind(tmp_path):
    # a passing CLI process (it pays an interpreter, torch and a zygote; a failing one's exit 1 is
    # test_cli_errors', a crashed one's exit 3 and leftovers test_isolation's, a usage error's
    # exit 2 test_cli_errors'). Its case litters its ranks' temp dir, as a framework making temp
    # dirs at import does (wandb, under torchtitan): the ranks' TMPDIR is the pool's own folder,
    # removed with it
    tag = f"SP_HARNESS_TEST_TAG=cli-{os.getpid()}-{time.time_ns()}"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)), SP_HARNESS_TEST_TAG=tag.split("=")[1],
               TMPDIR=str(scratch))
    ok = subprocess.run([sys.executable, "-m", "sp_harness.cli", "check", "--case", f"{FAULTY}:LITTERING",
                         "--world-size", "2", "--json", str(tmp_path / "v.json")], capture_output=True, text=True,
                        env=env, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS" in ok.stdout and (tmp_path / "v.json").exists()
    assert not list(scratch.iterdir()), f"left behind: {list(scratch.iterdir())}"
    time.sleep(0.5)
    assert tagged_processes(tag) == [], "rank processes outlived the CLI"


def _interrupt_mid_run(sig, tmp_path, *, times: int = 1, after_s: float = 1.0):
    """Start a hanging check, send `sig` `times` once its ranks exist; (driver, stderr, ranks
    still alive). Its temporary files go to `tmp_path`, which must end up empty."""
    import signal

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)), TMPDIR=str(tmp_path))
    # pytest-xdist workers run with SIGINT ignored, which a child inherits; a terminal never does
    proc = subprocess.Popen([sys.executable, "-m", "sp_harness.cli", "check", "--case", f"{FAULTY}:HANGING",
                             "--world-size", "2", "--timeout", "60"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_ranks(proc.pid)[0]) < 2:
        time.sleep(0.2)
    ranks, servers = _ranks(proc.pid)
    assert len(ranks) == 2
    time.sleep(after_s)
    for _ in range(times):
        proc.send_signal(sig)
        time.sleep(0.1)
    _, err = proc.communicate(timeout=60)
    time.sleep(0.5)
    alive = [pid for pid in ranks + servers if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not list(tmp_path.iterdir()), f"left behind: {list(tmp_path.iterdir())}"
    return proc, err, alive


@pytest.mark.parametrize("times", [1, pytest.param(3, marks=pytest.mark.exhaustive(
    "the fast tier presses Ctrl-C once; SIGTERM (while the ranks start) has its own test"))])
def test_ctrl_c_leaves_no_rank_behind(times, tmp_path):
    import signal

    proc, err, alive = _interrupt_mid_run(signal.SIGINT, tmp_path, times=times)
    assert not alive, f"rank processes {alive} outlived the driver"
    assert proc.returncode == 130
    assert "Traceback" not in err, err


def test_sigterm_while_ranks_start_leaves_nothing_behind(tmp_path):
    import signal

    # at once: the ranks are still starting. SIGTERM takes Ctrl-C's path (cli._on_signal raises
    # its KeyboardInterrupt subclass, and the same cleanup runs), so this is also Ctrl-C's early
    # press; a press mid-run is test_ctrl_c_leaves_no_rank_behind's
    proc, err, alive = _interrupt_mid_run(signal.SIGTERM, tmp_path, after_s=0.0)
    assert not alive, f"rank processes {alive} outlived the driver"
    assert proc.returncode == 143
    assert "Traceback" not in err, err


@pytest.mark.exhaustive("test_sigterm_while_ranks_start_leaves_nothing_behind sends SIGTERM at the same moment, "
                        "which takes the same handler and cleanup (cli._on_signal); Ctrl-C mid-run has its own test")
def test_ctrl_c_while_ranks_start_leaves_nothing_behind(tmp_path):
    import signal

    # at once: the ranks are still importing torch
    proc, err, alive = _interrupt_mid_run(signal.SIGINT, tmp_path, after_s=0.0)
    assert not alive, f"rank processes {alive} outlived the driver"


@pytest.mark.exhaustive("the fast tier sends SIGTERM while the ranks start (test_sigterm_while_ranks_start_"
                        "leaves_nothing_behind) and Ctrl-C, the same handler, mid-run (test_ctrl_c_leaves_no_rank_behind)")
def test_sigterm_leaves_no_rank_behind(tmp_path):
    import signal

    proc, err, alive = _interrupt_mid_run(signal.SIGTERM, tmp_path)
    assert not alive, f"rank processes {alive} outlived the driver"
    assert proc.returncode == 143
    assert "Traceback" not in err, err


def test_a_jobs_timeout_does_not_count_the_ranks_start(tmp_path):
    # a fresh pool: its ranks import torch, DTensor (sympy) and the cases on start-up (tens of
    # seconds on a loaded runner), under the start budget; the job's own timeout only has to cover
    # seed-mlp's three small steps
    from sp_harness.checks.side_by_side import check
    from sp_harness.launch.manager import PoolManager

    manager = PoolManager()
    try:
        res = check(CheckConfig(case="seed-mlp", world_size=2, timeout_s=20), manager)
        assert res.verdict == PASS, res.reason
        assert manager.get(2).start_s > 0
    finally:
        manager.close()
