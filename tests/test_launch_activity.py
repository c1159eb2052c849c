"""Whether a process group has stopped, read from /proc (sp_harness.launch.activity): the gate
before the driver takes a rank's stack, on real processes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from sp_harness.launch.activity import activity, stopped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BUSY = "while True: pass"
SLEEPING_PARENT_OF_BUSY = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {BUSY!r}]); time.sleep(60)"


def _groups(*codes: str) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for code in codes]
    time.sleep(1.5)  # past the interpreters' start-up, which uses the CPU (started together: one wait)
    return procs


def _end(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_sleeping_group_has_stopped_and_a_busy_one_has_not():
    sleeping, busy, parent = _groups("import time; time.sleep(60)", BUSY, SLEEPING_PARENT_OF_BUSY)
    try:
        assert stopped([sleeping.pid])
        assert not stopped([busy.pid]) and not stopped([sleeping.pid, busy.pid])
        # the group, not the process: a rank waiting on its busy reference process is working
        assert not stopped([parent.pid])
        first = activity([busy.pid, sleeping.pid])
        time.sleep(0.3)
        second = activity([busy.pid, sleeping.pid])
        assert first is not None and second is not None
        assert second[busy.pid].cpu_ticks > first[busy.pid].cpu_ticks
        assert second[sleeping.pid] == first[sleeping.pid] and not first[sleeping.pid].running
    finally:
        for proc in (sleeping, busy, parent):
            _end(proc)


def test_without_proc_the_caller_cannot_tell(tmp_path):
    assert activity([1], proc=str(tmp_path / "absent")) is None
    assert stopped([1], proc=str(tmp_path / "absent"))
