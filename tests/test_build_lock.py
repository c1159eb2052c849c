"""The torch extension build guard (cases/frameworks/common.py): a build killed mid-way leaves
torch's `lock` behind, which the next guarded build removes with a warning; while another process
builds (holds our flock) a guarded build waits and touches nothing. Pure: no framework, no
process group, no compile; TORCH_EXTENSIONS_DIR is the test's tmp_path."""

from __future__ import annotations

import fcntl
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest

from sp_harness.cases.frameworks.common import FLOCK_NAME, build_extension_exclusively

NAME = "sp_harness_test_ext"
JOIN_S = 60  # generous: only a hang should reach it

# Another builder: takes the flock, says so, holds it until killed.
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path / NAME


def _stale_lock(build_dir, age_s: float = 120.0):
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def _flock_is_free(build_dir) -> bool:
    fd = os.open(build_dir / FLOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_stale_torch_lock_is_removed_with_a_warning_and_the_build_runs_once(build_dir):
    start = time.monotonic()
    lock = _stale_lock(build_dir)
    calls = []
    with pytest.warns(UserWarning, match=r"removed a stale torch extension build lock") as caught:
        got = build_extension_exclusively(NAME, lambda: calls.append(1) or "module")
    assert got == "module" and calls == [1]
    assert not lock.exists()
    message = str(caught[0].message)
    assert str(lock) in message and "killed" in message
    # the lock ages while the test runs: a loaded CPU read 121 s for a lock made 120 s old
    age = re.search(r"\((\d+) s old\)", message)
    assert age is not None, message
    assert 120 <= int(age.group(1)) <= 120 + math.ceil(time.monotonic() - start), message


def test_without_a_lock_the_build_runs_and_nothing_is_warned(build_dir):
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_extension_exclusively(NAME, lambda: calls.append(1) or 7) == 7
    assert calls == [1]
    assert build_dir.is_dir() and (build_dir / FLOCK_NAME).exists()  # torch's rule put it under TORCH_EXTENSIONS_DIR


def test_while_another_process_builds_the_guard_waits_and_leaves_its_lock(build_dir):
    lock = _stale_lock(build_dir)  # here: the other builder's live lock
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(build_dir / FLOCK_NAME)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        built, result = threading.Event(), {}

        def guarded():
            result["got"] = build_extension_exclusively(NAME, lambda: built.set() or "module")

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            thread = threading.Thread(target=guarded, daemon=True)
            thread.start()
            assert not built.wait(1.0), "built while another process held the flock"
            assert lock.exists() and thread.is_alive()
            holder.kill()  # dies mid-build, its torch lock left behind
            holder.wait(JOIN_S)
            thread.join(JOIN_S)
        assert not thread.is_alive() and built.is_set() and result["got"] == "module"
        assert not lock.exists()
        assert any(str(lock) in str(w.message) for w in caught)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(JOIN_S)
        holder.stdout.close()


def test_a_build_that_raises_releases_the_flock(build_dir):
    def broken():
        raise RuntimeError("ninja failed")

    with pytest.raises(RuntimeError, match="ninja failed"):
        build_extension_exclusively(NAME, broken)
    assert _flock_is_free(build_dir)
    assert build_extension_exclusively(NAME, lambda: 3) == 3
