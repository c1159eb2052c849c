"""Stage: launch. A rank's first moments in a process just forked by the zygote
(sp_harness.launch.zygote_server): it becomes what `subprocess.Popen` made of a rank, then runs it.

A forked rank takes the pool's exact environment, a session of its own (setsid: the pool's killpg
takes it and what it starts), /dev/null as stdin and its log as stdout and stderr, as a
subprocess-started rank had, and runs `worker.main` under Python's normal exit (an uncaught
exception prints its traceback to the log and exits 1). Before that it forks its first companion
(sp_harness.launch.companion.fork_spare), while it is still single-threaded. It dies with the
zygote (PR_SET_PDEATHSIG). One thing a fork cannot renew: Python's str hash seed is fixed at
interpreter start, so every rank of a zygote iterates a set of strings in the same order, where
fresh interpreters each drew their own seed (a case whose collectives follow such an order desyncs
under torchrun, not here; run with SP_HARNESS_FORKSERVER=0 to draw a seed per rank).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tempfile


def set_pdeathsig() -> None:
    """This process gets SIGKILL when its parent (the thread that forked it) ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def become_rank(spec_json: str, log_path: str, env: dict[str, str], cwd: str, zygote_pid: int) -> None:
    """In a forked child: set up as `subprocess.Popen` set up a rank, then run it."""
    os.setsid()  # the pool's killpg takes the rank and everything it starts
    set_pdeathsig()
    if os.getppid() != zygote_pid:
        os._exit(1)  # the zygote died before the death signal was armed
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the pool's TMPDIR, not the zygote's, from now on
    _reseed()
    # `python -m` put the zygote's directory first on its path; a rank started fresh had its own
    if sys.path and sys.path[0] == os.getcwd():
        sys.path[0] = cwd
    try:
        os.chdir(cwd)
    except OSError:
        pass  # the driver's directory is gone: a subprocess would have inherited it as it was
    from sp_harness.launch import companion, worker
    from sp_harness.launch.wire import WorkerSpec

    spec = WorkerSpec.from_json(spec_json)
    sys.argv = [worker.__file__ or "worker.py", spec_json]  # what a subprocess-started rank saw
    sys.path[:] = list(spec.sys_path) + [p for p in sys.path if p not in spec.sys_path]
    companion.fork_spare()  # while no thread runs: forking later would not be safe
    worker.main(spec)


def _reseed() -> None:
    """numpy's global generator, seeded from the OS at import, would be the zygote's in every rank
    (Python's `random` reseeds itself at fork; torch's default seed is fixed in a fresh process too)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
