"""The rank fork server (sp_harness.launch.zygote, issue 47): ranks forked from a process that has
imported torch behave as ranks started as fresh interpreters did (exit codes, signals, logs, kernel
family, temp dirs), both start paths keep working, and nothing outlives the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sp_harness.launch import zygote, zygote_registry
from sp_harness.launch.failure import RankFailure
from sp_harness.launch.manager import RANK_PRELOAD, PoolManager
from sp_harness.launch.pool import RankPool
from sp_harness.launch.wire import PoolOptions
from sp_harness.launch.worker import health_check
from sp_harness.launch.zygote_server import PRELOAD_ENV, SCALAR_TENSOR_OPS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux's")


def _how_started(_payload: object) -> tuple[int, str, str, str, str]:
    """(parent pid, the companion's kind, TMPDIR, the temp dir Python resolves, inductor's cache
    folder) on a rank."""
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from sp_harness.launch import companion

    spare = companion._SPARE
    return (os.getppid(), type(spare.proc).__name__ if spare else "", os.environ["TMPDIR"],
            tempfile.gettempdir(), cache_dir())


def _capability(_payload: object) -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _numpy_draw(_payload: object) -> int:
    import numpy

    return int(numpy.random.randint(2**31))


def _exit_3(_payload: object) -> None:
    os._exit(3)


def _kill_self(_payload: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module", autouse=True)
def _default_zygote_in_use(sp_pool):
    """A pool of this worker's on the default zygote for the whole file, as the suite's other
    files leave one: a test's PoolManager.close() then ends only the zygotes it made idle, and the
    next test forks from the warm one instead of paying a zygote's start (seconds) again."""
    sp_pool.run(1, health_check, None, timeout_s=120, label="hold")


# the fresh interpreters' path on one rank (each such rank and its companion pay torch's import;
# ranks of either path meet through the same store), the forked path on two
@pytest.mark.parametrize("forkserver, world_size", [("1", 2), ("0", 1)], ids=["forked", "subprocess"])
def test_a_pool_job_runs_on_either_start_path(forkserver, world_size, monkeypatch):
    if forkserver == "0":
        monkeypatch.setenv(zygote_registry.ENV_VAR, "0")
    else:  # the default: on Linux, forked
        monkeypatch.delenv(zygote_registry.ENV_VAR, raising=False)
    # what torch itself writes into the driver's environment at `import torch._dynamo` (a torch
    # optimizer's first step): neither the ranks' inductor cache nor a zygote key of its own
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = RankPool(1)  # this environment's zygote, as it was before torch wrote the folder
    before.run(health_check, None, timeout_s=120, label="before")
    zygotes = len(zygote_registry._REGISTRY)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    pool = RankPool(world_size)
    try:
        assert pool.run(health_check, None, timeout_s=120, label="path") == [world_size] * world_size
        got = pool.run(_how_started, None, timeout_s=60, label="path")
        kinds = {type(p).__name__ for p in pool._procs}
        scratch = pool.scratch_dir
    finally:
        pool.close()
        before.close()
    parents = {g[0] for g in got}
    if forkserver == "1":
        # forked by the zygote, each with a forked companion
        assert kinds == {"RankProcess"} and os.getpid() not in parents
        assert {g[1] for g in got} == {"ForkedChild"}
        assert len(zygote_registry._REGISTRY) == zygotes  # forked from the one `before` started
    else:
        assert kinds == {"Popen"} and parents == {os.getpid()}
        assert {g[1] for g in got} == {"Popen"}
    # temp files of either go to the pool's folder, removed with it
    assert {g[2] for g in got} == {g[3] for g in got} == {scratch}
    assert all(g[4].startswith(scratch + os.sep) for g in got), got


def test_the_kernel_family_follows_each_pools_environment():
    # torch fixes its kernel family at the first op: a zygote that ran one, or a pool forked from
    # a zygote of another environment, would run the native family under ATEN_CPU_CAPABILITY
    import torch

    native = torch.backends.cpu.get_cpu_capability()
    forced = PoolManager(PoolOptions(env=(("ATEN_CPU_CAPABILITY", "default"),)))
    plain = PoolManager()
    try:
        assert forced.run(2, _capability, None, timeout_s=120, label="forced") == ["DEFAULT", "DEFAULT"]
        assert plain.run(2, _capability, None, timeout_s=120, label="native") == [native, native]
        assert all(isinstance(p, zygote.RankProcess) for m in (forced, plain) for p in m.get(2)._procs)
    finally:
        forced.close()
        plain.close()


def test_each_rank_draws_its_own_numpy_seed():
    # numpy seeds its global generator from the OS at import: in the zygote, once for all ranks
    pool = RankPool(2)
    try:
        draws = pool.run(_numpy_draw, None, timeout_s=120, label="seed")
        assert len(set(draws)) == 2, draws
    finally:
        pool.close()


def test_exits_and_signals_are_reported_as_for_a_subprocess():
    pool = RankPool(2)
    try:
        with pytest.raises(RankFailure) as exited:
            pool.run(_exit_3, None, timeout_s=60, label="exit")
        assert {(e.kind, e.exit_code) for e in exited.value.errors} == {("exited", 3)}
        with pytest.raises(RankFailure) as killed:
            pool.run(_kill_self, None, timeout_s=60, label="kill")
        assert {(e.kind, e.signal_name, e.exit_code) for e in killed.value.errors} == {("signal", "SIGKILL", -9)}
        assert "killed by SIGKILL" in str(killed.value)
    finally:
        pool.close()


def test_an_uncaught_exception_exits_1_with_its_traceback_in_the_log(tmp_path):
    forks = zygote_registry.for_env(dict(os.environ), 120)
    assert forks is not None
    log = tmp_path / "rank.log"
    proc = forks.spawn("not a spec", log_path=str(log), env=dict(os.environ), cwd=str(tmp_path))
    assert proc.wait(timeout=60) == 1 and proc.poll() == 1
    assert "Traceback" in log.read_text() and "JSONDecodeError" in log.read_text()


def test_a_live_ranks_handle_times_out_as_popen_does():
    pool = RankPool(1)
    try:
        pool.run(health_check, None, timeout_s=120, label="wait")
        (rank,) = pool._procs
        with pytest.raises(subprocess.TimeoutExpired):
            rank.wait(timeout=0.2)
        assert rank.poll() is None
    finally:
        pool.close()
    assert rank.poll() is not None


def _every_preload() -> str:
    """What every CPU fork server imports (`RANK_PRELOAD`: the checks' modules), then every
    registered case's `Case.preload` entries, in order, as SP_HARNESS_PRELOAD takes them."""
    import sp_harness.checks  # noqa: F401  (adds its modules to RANK_PRELOAD)
    from sp_harness.config.registry import all_cases

    entries = [*RANK_PRELOAD, *(e for case in all_cases().values() for e in case.preload)]
    assert "sp_harness.checks:all_checks" in entries, RANK_PRELOAD
    return ",".join(dict.fromkeys(entries))


@pytest.mark.parametrize("preload", [False, pytest.param(True, marks=pytest.mark.exhaustive(
    "the fast tier runs every case's preload at once through zygote_server._preload, whose own check fails on a "
    "thread an import starts, in test_the_preload_dispatches_no_op_and_..., and a zygote's single thread at [built-in]"))],
    ids=["built-in", "every-framework-preload"])
def test_the_zygote_is_single_threaded_when_it_forks(preload):
    env = ((PRELOAD_ENV, _every_preload()),) if preload else ()
    pool = RankPool(1, PoolOptions(env=env))
    try:
        pool.run(health_check, None, timeout_s=300, label="threads")
        pids = [z.proc.pid for key, z in zygote_registry._REGISTRY.items()
                if dict(key).get(PRELOAD_ENV) == dict(env).get(PRELOAD_ENV)]
        assert pids
        for pid in pids:
            with open(f"/proc/{pid}/status") as f:
                assert "Threads:\t1\n" in f.read()
    finally:
        pool.close()


def test_the_preload_dispatches_no_op_and_the_frameworks_make_scalar_tensors_at_most(tmp_path):
    # the profiler records every dispatched op. A zygote's import, with what every CPU pool's
    # zygote imports (RANK_PRELOAD), must record none; then every case's preload at once (one
    # process: the first's modules are imported, each "module:function" a no-op again): beyond a
    # tensor made from a Python scalar at a module's top level (zygote_server.PRELOAD_ENV), an op
    # could run a parallel region in the fork server. _preload itself raises (exit 1 here) where
    # an import starts a thread, as it would fail a zygote (the zygote's own single thread, before
    # any case's preload, is test_the_zygote_is_single_threaded_when_it_forks[built-in])
    script = textwrap.dedent("""
        import os, sys
        from torch.autograd.profiler import profile
        from sp_harness.launch.zygote_server import PRELOAD_ENV, _preload
        for entries in sys.argv[1:]:
            os.environ[PRELOAD_ENV] = entries
            with profile() as prof:
                _preload()
            print("ops:", sorted({e.name for e in prof.function_events}), flush=True)
        """)
    import sp_harness.checks  # noqa: F401  (adds its modules to RANK_PRELOAD)

    assert RANK_PRELOAD
    entries = _every_preload()
    assert "torchtitan" in entries and "megatron" in entries and "deepspeed" in entries, entries
    run = subprocess.run([sys.executable, "-c", script, ",".join(RANK_PRELOAD), entries], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert run.returncode == 0, run.stderr
    # (an import may print to stdout: deepspeed's accelerator warning)
    built_in, frameworks = [line[len("ops: "):] for line in run.stdout.splitlines() if line.startswith("ops: ")]
    assert built_in == "[]", run.stdout
    ops = set(eval(frameworks))  # a printed list of op names
    assert ops and ops <= SCALAR_TENSOR_OPS, sorted(ops - SCALAR_TENSOR_OPS)


def test_a_cases_preload_reaches_its_cpu_pools_zygote_only():
    gloo, nccl = PoolManager(), PoolManager(PoolOptions(backend="nccl", devices=(0,)))
    try:
        ranks = ",".join(RANK_PRELOAD)  # every CPU pool's, first
        assert dict(gloo.get(1, "group:x", preload=("json", "a.b:f")).options.env)[PRELOAD_ENV] == f"{ranks},json,a.b:f"
        assert dict(gloo.get(1, "group:y").options.env).get(PRELOAD_ENV, "") == ranks
        assert PRELOAD_ENV not in dict(nccl.get(1, "group:x", preload=("json",)).options.env)
    finally:
        gloo.close()
        nccl.close()


def test_a_dead_zygote_ends_its_ranks_and_the_pool_restarts():
    pool = RankPool(2, PoolOptions(env=(("SP_TEST_ZYGOTE", "victim"),)))
    try:
        pool.run(health_check, None, timeout_s=120, label="victim")
        ranks = [p.pid for p in pool._procs]
        (victim,) = [z for z in zygote_registry._REGISTRY.values() if any(p in z._children for p in ranks)]
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert not _wait_gone(ranks)
        assert all(p.wait(timeout=10) == -signal.SIGKILL for p in pool._procs) and not pool.alive
        assert pool.run(health_check, None, timeout_s=120, label="victim") == [2, 2]  # a new zygote
        assert victim not in zygote_registry._REGISTRY.values()
    finally:
        pool.close()


DRIVER = """
    import os, sys, threading, time
    from sp_harness.launch import zygote_registry
    from sp_harness.launch.manager import PoolManager
    from sp_harness.launch.wire import PoolOptions
    from sp_harness.launch.worker import health_check

    manager = PoolManager(PoolOptions(env=(("SP_TEST_ZYGOTE", "driver"),)))
    if sys.argv[1] == "thread-kill":
        # started from a thread that then ends: the death signal would follow that thread
        worker = threading.Thread(target=manager.run, args=(2, health_check, None),
                                  kwargs=dict(timeout_s=120, label="driver"))
        worker.start()
        worker.join()
        time.sleep(0.5)
        assert manager.get(2).alive and all(z.alive for z in zygote_registry._REGISTRY.values())
    else:
        manager.run(2, health_check, None, timeout_s=120, label="driver")
    (z,) = zygote_registry._REGISTRY.values()
    ranks = [p.pid for p in manager.get(2)._procs]
    companions = [int(c) for r in ranks for c in open(f"/proc/{r}/task/{r}/children").read().split()]
    print(z.proc.pid, *ranks, *companions, flush=True)
    if sys.argv[1].endswith("kill"):
        os.kill(os.getpid(), 9)
    manager.close()
    print(sorted(os.listdir(os.environ["TMPDIR"])), flush=True)
    """


@pytest.mark.parametrize("how", [pytest.param("close", marks=pytest.mark.exhaustive(
    "the fast tier ends a driver that closes its pools (at exit) in test_engine's test_cli_leaves_no_process_nor_"
    "file_behind, which finds none of its processes (the zygote, ranks, companions: all carry its environment) nor "
    "folders, and test_xdist_workers_close_their_pools_before_they_report_finished finds close() removes them")),
    pytest.param("kill", marks=pytest.mark.exhaustive(
    "the fast tier SIGKILLs the driver in [thread-kill]: the same kill and checks, with its zygote started "
    "from a thread, where only its pipe's EOF ends it (a main-thread start adds the death signal)")),
    "thread-kill"])
def test_nothing_outlives_the_driver(how, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(DRIVER), how], capture_output=True, text=True,
                         timeout=300, env=env)
    lines = run.stdout.strip().splitlines()
    pids = [int(p) for p in lines[0].split()]
    assert len(pids) == 5, run.stdout + run.stderr  # the zygote, 2 ranks, their 2 companions
    assert not _wait_gone(pids), "outlived the driver"
    if how == "close":
        assert run.returncode == 0 and lines[1] == "[]", run.stdout + run.stderr  # the zygote's folder too
    else:
        from sp_harness.launch.scratch import sweep_orphans

        assert run.returncode == -signal.SIGKILL
        sweep_orphans(root=str(tmp_path))  # what the next pool's start does
    assert not list(tmp_path.iterdir())


def test_each_process_loads_a_cases_preload_before_its_setup_where_no_fork_server_did(tmp_path, monkeypatch):
    # a GPU pool's or a fresh interpreter's ranks: setup_once imports the preload, once
    from sp_harness.launch.case_setup import setup_once

    (tmp_path / "pre_mod.py").write_text("CALLS = []\n\ndef hit():\n    CALLS.append('preload')\n")
    (tmp_path / "pre_case.py").write_text(textwrap.dedent("""
        import dataclasses
        import pre_mod
        from sp_harness.config.registry import get_case
        CASE = dataclasses.replace(get_case("seed-mlp"), name="pre-case", preload=("pre_mod:hit",),
                                   setup=lambda: pre_mod.CALLS.append("setup"))
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"{tmp_path / 'pre_case.py'}:CASE"
    assert setup_once(name) and not setup_once(name)
    import pre_mod

    assert pre_mod.CALLS == ["preload", "setup"]
