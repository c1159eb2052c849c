"""Stage: launch. A rank's companion process: a child the rank starts while the pool warms
up, which imports torch and then waits to be told what to serve (a module-level function, sent
by name as a job is). The reference process (sp_harness.checks.refproc) is one: started here, its imports (seconds
on a loaded machine) overlap the rank's own warm-up and are pool start-up, never a job's time.

A rank forked by the zygote (sp_harness.launch.zygote) forks its first companion before it
starts any thread (`fork_spare`): torch is already imported there, so the companion is ready in
milliseconds instead of paying a fresh interpreter's imports. A later companion (the spare was
taken, or died) is started from a rank whose gloo and OpenMP threads make a fork unsafe: it is a
fresh interpreter (`_spawn`), as every companion of a subprocess-started rank is.

The companion dies with the rank (PR_SET_PDEATHSIG) and is in the rank's process group, so a
pool's kill of the group takes it too. It ignores SIGINT: Ctrl-C is the driver's to handle.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from sp_harness.launch.wire import job_ref


class ForkedChild:
    """A child this process forked, with what a `subprocess.Popen` offers its users here: `pid`,
    `poll()`, `wait(timeout)` (raising `subprocess.TimeoutExpired`), `kill()`."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.args = [sys.executable, "-m", __name__, f"forked pid {pid}"]

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost (Popen says 0)
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not once reaped: its pid may be another process's by now
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass(kw_only=True)
class Companion:
    proc: subprocess.Popen | ForkedChild
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


def fork_spare() -> None:
    """Fork the spare companion from this process: a rank just forked by the zygote, where torch
    is imported and no thread runs yet (sp_harness.launch.zygote). Never from a process with
    threads: a fork copies only the calling thread, and a lock another one held stays locked."""
    global _SPARE
    parent, child = socket.socketpair()
    rank = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        parent.close()
        code = 1
        try:
            numpy = sys.modules.get("numpy")
            if numpy is not None:
                numpy.random.seed()  # seeded from the OS, as a fresh companion's is, not the rank's copy
            _main(child.detach(), parent_pid=rank)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            # never the rank's exit: its atexit hooks and finalizers are the rank's, not ours
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    child.close()
    _SPARE = Companion(proc=ForkedChild(pid), conn=Connection(parent.detach()))


def _spawn() -> Companion:
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "sp_harness.launch.companion", str(child.fileno())],
                            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
    child.close()
    return Companion(proc=proc, conn=Connection(parent.detach()))


def _main(fd: int, parent_pid: int | None = None) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if parent_pid is not None and os.getppid() != parent_pid:
        return  # the rank died before the death signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from sp_harness.config.registry import all_cases

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
