"""No verdict depends on what ran before it: a case from a user's file runs in rank processes no
other case used, a case's setup runs once per process outside the job's timeout (its failure is a
setup error, exit 3), and a timeout kills each rank's whole process tree. Real gloo ranks."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from processes import tagged_processes

from sp_harness import CheckConfig
from sp_harness.checks.side_by_side import check
from sp_harness.launch.manager import PoolManager

CASES = os.path.join(os.path.dirname(__file__), "isolation_cases.py")


def _run(manager, name, **fields):
    return check(CheckConfig(case=f"{CASES}:{name}", world_size=2, **fields), manager)


@pytest.fixture
def manager():
    m = PoolManager(max_pools=4)
    yield m
    m.close()


@pytest.mark.parametrize("order", [("PATCHING", "TWIN"), pytest.param(("TWIN", "PATCHING"), marks=pytest.mark.exhaustive(
    "the fast tier runs the patcher first here, and both orders through the plugin in test_user_project's "
    "test_users_pytest_runs_its_case_and_ours"))])
def test_a_patching_mutant_and_its_twin_get_their_standalone_verdicts_on_one_manager(manager, order):
    verdicts = {name: _run(manager, name).verdict for name in order}
    assert verdicts == {"PATCHING": "FAIL", "TWIN": "PASS"}


def test_cases_declared_shared_do_share_processes(manager):
    """What isolation prevents: the twin run after the patcher in the same processes FAILs."""
    assert _run(manager, "PATCHING_SHARED").verdict == "FAIL"
    assert _run(manager, "TWIN_SHARED").verdict == "FAIL"


@pytest.mark.exhaustive("the fast tier runs the same sequence through the plugin in the user's pytest run of "
                        "test_user_project's test_users_pytest_runs_its_case_and_ours (its test_user_isolation.py)")
def test_through_the_plugin_each_case_gets_its_standalone_verdict(tmp_path):
    (tmp_path / "test_scratch.py").write_text(textwrap.dedent(f"""
        from sp_harness import CheckConfig

        def test_both(sp_check):
            # the twin after the patcher, and the patcher after the twin
            got = [sp_check(CheckConfig(case="{CASES}:" + n, world_size=2)).verdict
                   for n in ("PATCHING", "TWIN", "PATCHING")]
            assert got == ["FAIL", "PASS", "FAIL"], got
        """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "test_scratch.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.exhaustive("two 25 s setups; the fast tier runs every framework case's setup (a 5-20 s import) on the "
                        "budget this pins, and a failing setup below")
def test_setup_runs_once_per_process_outside_the_jobs_timeout(tmp_path, monkeypatch):
    log = tmp_path / "setup.log"
    monkeypatch.setenv("SP_TEST_SETUP_LOG", str(log))
    monkeypatch.setenv("SP_TEST_SETUP_S", "25")
    m = PoolManager()  # started after the env is set: its ranks inherit it
    try:
        # a setup longer than the job's timeout does not make the job time out
        assert _run(m, "WITH_SETUP", timeout_s=20).verdict == "PASS"
        assert _run(m, "WITH_SETUP", timeout_s=20).verdict == "PASS"
    finally:
        m.close()
    pids = log.read_text().split()
    # each rank and each rank's reference process ran it, once
    assert len(pids) == len(set(pids)) == 4, pids


def test_a_failing_setup_is_the_verdict_error_exit_3(tmp_path):
    # Case.setup raising: the check could not run, which is no verdict on the code (not a FAIL);
    # and a CLI whose ranks crashed leaves no process nor file behind (a passing one:
    # test_engine's test_cli_leaves_no_process_nor_file_behind)
    tag = f"cli-setup-{os.getpid()}-{time.time_ns()}"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = subprocess.run([sys.executable, "-m", "sp_harness.cli", "check", "--case", f"{CASES}:SETUP_FAILS",
                          "--world-size", "2"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=dict(os.environ, SP_HARNESS_TEST_TAG=tag, TMPDIR=str(scratch)))
    assert out.returncode == 3, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERROR: ")]
    assert len(lines) == 1 and "SETUP_FAILS" in lines[0] and "setup" in lines[0], out.stdout
    assert not [line for line in out.stdout.splitlines() if line.startswith("FAIL")], out.stdout
    assert not list(scratch.iterdir()), f"left behind: {list(scratch.iterdir())}"
    time.sleep(0.5)
    assert tagged_processes(f"SP_HARNESS_TEST_TAG={tag}") == [], "rank processes outlived the CLI"



def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_timeout_kills_each_ranks_children(tmp_path, monkeypatch):
    log = tmp_path / "children.log"
    monkeypatch.setenv("SP_TEST_CHILD_LOG", str(log))
    m = PoolManager()
    try:
        res = _run(m, "LEAVES_A_CHILD", timeout_s=5)
    finally:
        m.close()
    assert res.verdict == "FAIL" and res.crash_kind == "timeout", res.reason
    children = [int(p) for p in log.read_text().split()]
    assert len(children) == 2
    deadline = time.monotonic() + 10  # reaping is the init process's, not instant
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)]


def test_a_killed_reference_process_is_reported_with_its_signal_on_the_next_send():
    # the OOM killer takes a rank's reference process between two jobs: the next job's send hits
    # a broken pipe, and the user must read how it died, not "BrokenPipeError" (found by a
    # training-size campaign draw on a machine out of memory)
    import signal

    from sp_harness.checks.refproc import ReferenceProcess, ReferenceProcessError, TraceAll

    proc = ReferenceProcess()
    try:
        proc.proc.kill()
        proc.proc.wait(timeout=30)
        with pytest.raises(ReferenceProcessError, match=f"signal {int(signal.SIGKILL)}"):
            proc.send(TraceAll(full={}, batch=None, skip=frozenset()))
    finally:
        proc.close()


def test_tensors_cross_the_reference_pipe_bit_for_bit_with_their_strides():
    # refproc.dumps sends a dense CPU tensor as its bytes; every other kind takes torch's pickling
    import pickle

    import torch

    from sp_harness.checks.refproc import dumps

    torch.manual_seed(0)
    sent = {"f64": torch.randn(3, 4, dtype=torch.float64), "transposed": torch.randn(4, 3).t(),
            "permuted": torch.randn(2, 3, 4).permute(2, 0, 1), "bf16": torch.randn(2, 3).to(torch.bfloat16),
            "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "offset": torch.arange(10)[2:5],
            "bool": torch.tensor([True, False]), "signed": torch.tensor([-0.0, float("nan"), float("-inf")]),
            "strided": torch.randn(5, 5)[:, :2], "expanded": torch.randn(3, 1).expand(3, 4),
            "grad": torch.randn(3, requires_grad=True), "param": torch.nn.Parameter(torch.randn(2)),
            "conj": torch.randn(3, dtype=torch.complex64).conj()}
    got = pickle.loads(dumps({"nested": [sent]}))["nested"][0]
    for name, t in sent.items():
        r = got[name]
        assert (type(r), r.dtype, r.shape, r.requires_grad) == (type(t), t.dtype, t.shape, t.requires_grad), name
        a, b = r.detach().resolve_conj(), t.detach().resolve_conj()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), name
        if a.is_floating_point():
            assert torch.equal(torch.signbit(a), torch.signbit(b)), name
    for name in ("f64", "transposed", "permuted", "bf16", "offset"):
        assert got[name].stride() == sent[name].stride(), name  # what a kernel's path can depend on
