"""Stage: launch. A rank's companion process: a child the rank starts while the pool warms
up, which imports torch and then waits to be told what to serve (a module-level function, sent
by name as a job is). The reference process (sp_harness.checks.refproc) is one: started here, its imports (seconds
on a loaded machine) overlap the rank's own warm-up and are pool start-up, never a job's time.

The companion dies with the rank (PR_SET_PDEATHSIG) and is in the rank's process group, so a
pool's kill of the group takes it too. It ignores SIGINT: Ctrl-C is the driver's to handle.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from sp_harness.launch.wire import job_ref


@dataclass(kw_only=True)
class Companion:
    proc: subprocess.Popen
    conn: Connection
    """Its end of the socket pair: the companion says "ready", then the first message says what
    it becomes."""
    ready: bool = False


_SPARE: Companion | None = None


def start() -> None:
    """Start a spare companion (the pool's warm-up): it imports torch while the rank warms up."""
    global _SPARE
    if _SPARE is None or _SPARE.proc.poll() is not None:
        _SPARE = _spawn()


def ready() -> None:
    """Wait until the spare companion's imports are done (the end of the pool's warm-up)."""
    if _SPARE is not None:
        _ready(_SPARE)


def _ready(companion: Companion) -> None:
    """Wait for the companion's "ready" (it dying instead surfaces at its first use)."""
    if not companion.ready:
        try:
            companion.conn.recv_bytes()
        except (EOFError, OSError):
            return
        companion.ready = True


def set_up(case_name: str) -> None:
    """Run a case's per-process setup in the spare companion too (the pool's setup job): the
    companion a check's references will live in then has it done before any job's clock starts.
    A companion already serving runs it when it opens the case."""
    if _SPARE is None or _SPARE.proc.poll() is not None:
        return
    _ready(_SPARE)
    _SPARE.conn.send_bytes(_SETUP + case_name.encode())
    reply = _SPARE.conn.recv_bytes()
    if reply != b"done":
        raise RuntimeError("the companion's setup raised:\n" + reply.decode(errors="replace"))


_SETUP = b"setup:"


def take(serve: Callable[[Connection], object]) -> Companion:
    """A companion serving `serve(conn)` (a module-level function: the companion imports it by
    name): the spare one if it is alive, else a new one."""
    fn_ref = job_ref(serve)
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

    # the costs this process exists to pay early: torch's import, _dynamo's (a module's first
    # construction imports it), the built-in cases' (a user's case file imports them too)
    torch.nn.Linear(1, 1)
    all_cases()

    from sp_harness.launch.case_setup import setup_once
    from sp_harness.launch.wire import resolve

    conn = Connection(fd)
    try:
        conn.send_bytes(b"ready")
        msg = conn.recv_bytes()
        while msg.startswith(_SETUP):
            try:
                setup_once(msg[len(_SETUP):].decode())
                conn.send_bytes(b"done")
            except BaseException:
                conn.send_bytes(traceback.format_exc().encode())
            msg = conn.recv_bytes()
    except (EOFError, OSError):
        return  # the rank ended before it needed us
    resolve(msg.decode())(conn)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
