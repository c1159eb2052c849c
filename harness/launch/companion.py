"""Stage: launch ranks. A rank's companion process: a child the rank starts while the pool warms
up, which imports torch and then waits to be told what to serve (by "module:function", as a job
is). The reference process (sp_harness.checks.refproc) is one: started here, its start-up (torch's
import, seconds on a loaded machine) is pool start-up, never a job's time.

The companion dies with the rank (PR_SET_PDEATHSIG) and is in the rank's process group, so a
pool's kill of the group takes it too. It ignores SIGINT: Ctrl-C is the driver's to handle.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection


@dataclass(kw_only=True)
class Companion:
    proc: subprocess.Popen
    conn: Connection
    """Its end of the socket pair: the companion says "ready", then the first message says what
    it becomes."""
    ready: bool = False


_SPARE: Companion | None = None


def start() -> None:
    """Start a spare companion now and wait until its imports are done (the pool's warm-up, on the
    start-up budget), so that `take` finds it ready."""
    global _SPARE
    if _SPARE is None or _SPARE.proc.poll() is not None:
        _SPARE = _spawn()
    _ready(_SPARE)


def _ready(companion: Companion) -> None:
    """Wait for the companion's "ready" (it dying instead surfaces at its first use)."""
    if not companion.ready:
        try:
            companion.conn.recv_bytes()
        except (EOFError, OSError):
            return
        companion.ready = True


def take(fn_ref: str) -> Companion:
    """A companion serving `fn_ref(conn)`: the spare one if it is alive, else a new one."""
    global _SPARE
    companion = _SPARE if _SPARE is not None and _SPARE.proc.poll() is None else _spawn()
    _SPARE = None
    _ready(companion)
    companion.conn.send_bytes(fn_ref.encode())
    return companion


def _spawn() -> Companion:
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "sp_harness.launch.companion", str(child.fileno())],
                            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
    child.close()
    return Companion(proc=proc, conn=Connection(parent.detach()))


def _main(fd: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from sp_harness.config.case import all_cases

    # the costs this process exists to pay early: torch's import, _dynamo's, the case registry's
    torch.nn.Linear(1, 1)
    all_cases()

    from sp_harness.launch.worker import resolve

    conn = Connection(fd)
    try:
        conn.send_bytes(b"ready")
        fn_ref = conn.recv_bytes().decode()
    except (EOFError, OSError):
        return  # the rank ended before it needed us
    resolve(fn_ref)(conn)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
