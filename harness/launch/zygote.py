"""Stage: launch. The driver's handle on a fork server ("zygote"): a process that has imported
torch and the rank's modules once (sp_harness.launch.zygote_server) and forks a ready rank process
on request.

A rank started as a fresh `python -m sp_harness.launch.worker` pays an interpreter start and the
imports of torch, torch.distributed, DTensor (sympy) and torch._dynamo, and so does the companion
it starts (sp_harness.launch.companion): a 2-rank pool was four such processes, about 4 s on a
quiet 2-core machine and 12-20 s on a loaded one, and the test suite starts about 90 pools. A
fork of a process that has done those imports costs milliseconds, so a driver starts one zygote
per rank environment (sp_harness.launch.zygote_registry) and each pool's ranks are forked from it.

`Zygote` starts the server, asks it for ranks and hears how they end; `RankProcess` is a forked
rank as the pool sees it, used as it uses a `subprocess.Popen`. The driver is not a rank's
parent: the zygote reaps its children and sends each exit status over its pipe. Lifetimes: the
zygote dies with the driver (PR_SET_PDEATHSIG, and EOF on its pipe: the death signal follows the
thread that started it, so it is set only when that is the main thread), a rank with the zygote,
a companion with its rank. torch._dynamo makes its cache folder in the temp dir at import, so a
zygote's temp dir is a scratch folder of its own (sp_harness.launch.scratch: swept like a pool's
when the driver was SIGKILLed), removed when the zygote closes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from sp_harness.launch import zygote_server
from sp_harness.launch.scratch import ScratchDir


class ZygoteError(RuntimeError):
    """The zygote could not start, or could not fork a rank: the pool starts the rank as a fresh
    interpreter instead."""


class RankProcess:
    """A rank forked by a zygote, with what a pool uses of `subprocess.Popen`: `pid`, `poll()`,
    `wait(timeout)`, `kill()`. Its exit status comes from the zygote, its parent: a negative
    signal number for a signal's death, as Popen's; -SIGKILL where the zygote itself died (its
    ranks die with it)."""

    def __init__(self, zygote: Zygote, pid: int):
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self.args = [sys.executable, "-m", zygote_server.__name__, f"rank pid {pid}"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 0.2 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            # in slices: another thread may take the message that says this rank ended
            self._zygote.pump(min(left, 0.2))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # only while its exit is unreported: a pid the zygote reaped may be reused
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The driver's handle on one zygote process: start it, ask it for ranks, hear how they end."""

    def __init__(self, env: dict[str, str]):
        self._lock = threading.Lock()
        self._children: dict[int, RankProcess] = {}
        self._replies: dict[int, RankProcess | ZygoteError] = {}
        self._next_request = 0
        self.dead = False
        self.scratch = ScratchDir()
        parent, child = socket.socketpair()
        try:
            # the death signal follows the thread that forked: a zygote started from a thread
            # that ends would take every pool's ranks with it; EOF on the pipe covers that case
            deathsig = threading.current_thread() is threading.main_thread()
            with open(os.path.join(self.scratch.path, "zygote.log"), "w") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", zygote_server.__name__, str(child.fileno()), str(os.getpid()),
                     str(int(deathsig))],
                    env=dict(env, TMPDIR=self.scratch.path), pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            parent.close()
            self.scratch.remove()
            raise
        finally:
            child.close()
        self._conn = Connection(parent.detach())

    def wait_ready(self, timeout_s: float) -> None:
        if not self._conn.poll(timeout_s):
            raise ZygoteError(f"it did not start within {timeout_s:g}s")
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            raise ZygoteError(f"it exited while starting: {self.log_tail()}") from None
        if msg[0] != "ready":
            raise ZygoteError(f"its imports raised:\n{msg[1]}")

    def log_tail(self, num_lines: int = 8) -> str:
        try:
            with open(os.path.join(self.scratch.path, "zygote.log"), errors="replace") as f:
                return "\n".join(f.read().strip().splitlines()[-num_lines:])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    @property
    def idle(self) -> bool:
        """No rank of its is running (or unreported)."""
        self.pump(0.0)
        return not self._children

    def spawn(self, spec_json: str, *, log_path: str, env: dict[str, str], cwd: str,
              timeout_s: float = 60.0) -> RankProcess:
        """A rank process running `worker.main(spec)`, forked with `env` as its environment, `cwd`
        as its directory and `log_path` as its output."""
        with self._lock:
            if self.dead:
                raise ZygoteError("the fork server is gone")
            self._next_request += 1
            request = self._next_request
            try:
                self._conn.send(("spawn", request, (spec_json, log_path, env, cwd)))
            except OSError:
                self._died()
                raise ZygoteError("the fork server is gone") from None
        deadline = time.monotonic() + timeout_s
        while request not in self._replies:
            if self.dead:
                raise ZygoteError("the fork server died")
            if time.monotonic() > deadline:
                raise ZygoteError(f"the fork server did not fork within {timeout_s:g}s")
            self.pump(0.1)
        got = self._replies.pop(request)
        if isinstance(got, ZygoteError):
            raise got
        return got

    def pump(self, timeout: float) -> None:
        """Take what the zygote sent (forks done, exits), waiting up to `timeout` for a first message.
        Any thread may call it; one reads at a time."""
        if self.dead:
            return
        try:
            if not self._conn.poll(timeout):
                return
        except (OSError, ValueError):  # closed under us
            return
        with self._lock:
            try:
                while not self.dead and self._conn.poll(0):
                    self._take(self._conn.recv())
            except (EOFError, OSError):
                self._died()

    def _take(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "spawned":
            _, request, pid = msg
            proc = RankProcess(self, pid)
            self._children[pid] = proc
            self._replies[request] = proc
        elif kind == "spawn_failed":
            self._replies[msg[1]] = ZygoteError("the fork server could not fork:\n" + msg[2])
        elif kind == "exited":
            _, pid, status = msg
            if pid in self._children:
                self._children.pop(pid).returncode = os.waitstatus_to_exitcode(status)

    def _died(self) -> None:
        """The zygote is gone: its ranks died with it (their death signal), however they ended."""
        self.dead = True
        for proc in self._children.values():
            if proc.returncode is None:
                proc.returncode = -signal.SIGKILL
        self._children.clear()

    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the zygote and the ranks it forked; removes its temp dir."""
        with self._lock:
            self._died()
            # the zygote, on EOF, kills its ranks' process groups and exits
            self._conn.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.scratch.remove()
