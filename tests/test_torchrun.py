"""torchrun as a first-class launcher (issue 21): `sp-harness check` under torchrun exits 0 on
every PASSing run (no abort in C++ teardown after the verdict), and a hung rank is detected by
its own watchdog within the timeout, named with the case, config and rank, its stack printed,
and every rank ends (exit 124, torchrun ends the rest) instead of running on as an orphan."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests/faulty_cases.py"


def _torchrun(tmp_path, *argv: str, guard_s: float = 300) -> subprocess.CompletedProcess:
    # torchrun keeps its workers' logs in a torchelastic_* folder of its own under TMPDIR
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"TMPDIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "sp_harness.cli", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=guard_s)


def test_a_passing_check_under_torchrun_exits_0_every_time(tmp_path, tier):
    # an exit-time abort ('terminate called') came one run in a few: the full tier repeats it
    for _ in range(3 if tier == "full" else 1):
        run = _torchrun(tmp_path, "check", "--case", "seed-mlp", "--world-size", "2")
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        assert "PASS" in run.stdout
        assert "terminate called" not in run.stderr, run.stderr[-2000:]


def test_a_hung_rank_under_torchrun_is_named_and_every_rank_ends(tmp_path):
    # 5 s, as test_engine's hang: the watchdog times the job only (each rank's start and the
    # case's setup are outside it), and rank 0 is done or blocked on rank 1 within a second
    run = _torchrun(tmp_path, "check", "--case", f"{FAULTY}:HANGING", "--world-size", "2", "--timeout", "5")
    assert run.returncode != 0
    err = run.stderr
    assert f"case {FAULTY}:HANGING [ws=2" in err and "timed out after 5s" in err, err[-3000:]
    assert "rank 1 timed out" in err or "rank 0 timed out" in err
    assert "exitcode  : 124" in err  # torchrun's own report of the watchdog's exit
    assert "faulty_cases.py" in err  # the hung rank's own stack
    leftover = subprocess.run(["pgrep", "-f", f"{FAULTY}:HANGING"], capture_output=True, text=True)
    assert not leftover.stdout.strip(), leftover.stdout
