"""Stage: launch. A fork server ("zygote"): a process that has imported torch and the rank's modules
once, and forks a ready rank process on request.

A rank started as a fresh `python -m sp_harness.launch.worker` pays an interpreter start and the
imports of torch, torch.distributed, DTensor (sympy) and torch._dynamo, and so does the companion
it starts (sp_harness.launch.companion): a 2-rank pool was four such processes, about 4 s on a
quiet 2-core machine and 12-20 s on a loaded one, and the test suite starts about 90 pools. A
fork of a process that has done those imports costs milliseconds, so a driver starts one zygote
per rank environment (at the first pool that needs it) and each pool's ranks are forked from it.

Before it forks, the zygote must not run a torch op or start a thread. torch fixes its CPU kernel
family (ATEN_CPU_CAPABILITY) at the first dispatched op, and a parallel op starts OpenMP's thread
pool, which a forked child cannot use; a fork copies only the forking thread, so a lock another
thread held stays locked in the child. (numpy's OpenBLAS starts threads at import, and stops them
in its own pthread_atfork handler: the zygote is single-threaded at each fork.) The built-in
cases are imported too: their import dispatches no op, starts no thread and makes no folder, and
it saves each rank and companion their own import.

Zygotes are keyed by the environment they start under: the driver's, plus the pool's
`PoolOptions.env`, less the per-pool TMPDIR and SP_HARNESS_AUTHKEY (and PYTEST_CURRENT_TEST,
which pytest changes at every test phase). torch reads some of it at import or first use
(ATEN_CPU_CAPABILITY, OMP_NUM_THREADS), so a pool with another environment gets a zygote of its
own. A forked rank then takes the pool's exact environment, a session of its own (setsid: the
pool's killpg takes it and what it starts), /dev/null as stdin and its log as stdout and stderr,
as a subprocess-started rank had, and runs `worker.main` under Python's normal exit (an uncaught
exception prints its traceback to the log and exits 1). Before that it forks its first companion
(sp_harness.launch.companion.fork_spare), while it is still single-threaded. One thing a fork
cannot renew: Python's str hash seed is fixed at interpreter start, so every rank of a zygote
iterates a set of strings in the same order, where fresh interpreters each drew their own seed
(a case whose collectives follow such an order desyncs under torchrun, not here; run with
SP_HARNESS_FORKSERVER=0 to draw a seed per rank).

Lifetimes: the zygote dies with the driver (PR_SET_PDEATHSIG, and EOF on its pipe: the death
signal follows the thread that started it, so it is set only when that is the main thread), a
rank with the zygote (PR_SET_PDEATHSIG), a companion with its rank; a zygote whose pipe closes
kills the process groups of the ranks it forked. The driver is not a rank's parent, so the zygote
reaps its children and sends each exit status over its pipe; `RankProcess` is the driver's handle,
used as pool.py uses a `subprocess.Popen`. torch._dynamo makes its cache folder in the temp dir at
import, so a zygote's temp dir is a scratch folder of its own (sp_harness.launch.scratch: swept
like a pool's when the driver was SIGKILLed), removed when the zygote closes: at
`PoolManager.close` for a zygote no rank uses (`close_idle`), else at exit.

SP_HARNESS_FORKSERVER=0, or a platform other than Linux, starts every rank as a fresh interpreter
(`subprocess.Popen`), as before; so does a pool whose zygote failed to start (with a warning).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from multiprocessing.connection import Connection

from sp_harness.launch.scratch import ScratchDir

ENV_VAR = "SP_HARNESS_FORKSERVER"
# values each pool sets for itself (or pytest per test phase): never part of a zygote's key
PER_POOL = frozenset({"TMPDIR", "SP_HARNESS_AUTHKEY", "PYTEST_CURRENT_TEST"})
# zygotes no rank uses, kept beside the one in use (each holds torch's import: ~300 MB resident)
_MAX_IDLE = 2


def enabled() -> bool:
    """Whether pools fork their ranks from a zygote (Linux, unless SP_HARNESS_FORKSERVER=0)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and os.environ.get(ENV_VAR, "1") != "0"


class ZygoteError(RuntimeError):
    """The zygote could not start, or could not fork a rank: the pool starts the rank as a fresh
    interpreter instead."""


def _set_pdeathsig() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# ---------------------------------------------------------------- the driver's side


class RankProcess:
    """A rank forked by a zygote, with what pool.py uses of `subprocess.Popen`: `pid`, `poll()`,
    `wait(timeout)`, `kill()`. Its exit status comes from the zygote, its parent: a negative
    signal number for a signal's death, as Popen's; -SIGKILL where the zygote itself died (its
    ranks die with it)."""

    def __init__(self, zygote: Zygote, pid: int):
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self.args = [sys.executable, "-m", __name__, f"rank pid {pid}"]

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
                    [sys.executable, "-m", __name__, str(child.fileno()), str(os.getpid()), str(int(deathsig))],
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


_REGISTRY: OrderedDict[tuple[tuple[str, str], ...], Zygote] = OrderedDict()
_FAILED: dict[tuple[tuple[str, str], ...], str] = {}
_REGISTRY_LOCK = threading.Lock()


def for_env(env: dict[str, str], timeout_s: float) -> Zygote | None:
    """The zygote for ranks of environment `env` (started now if need be); None where it cannot
    start, with a warning: the pool then starts its ranks as subprocesses."""
    base = {k: v for k, v in env.items() if k not in PER_POOL}
    key = (("", sys.executable),) + tuple(sorted(base.items()))
    with _REGISTRY_LOCK:
        if key in _FAILED:
            return None
        zygote = _REGISTRY.pop(key, None)
        if zygote is not None and not zygote.alive:
            zygote.close()
            zygote = None
        if zygote is None:
            try:
                zygote = Zygote(base)
            except OSError as exc:
                _failed(key, f"{type(exc).__name__}: {exc}")
                return None
            try:
                zygote.wait_ready(timeout_s)
            except ZygoteError as exc:
                zygote.close()
                _failed(key, str(exc))
                return None
            except BaseException:  # Ctrl-C while it imports
                zygote.close()
                raise
        _REGISTRY[key] = zygote  # most recently used last
        idle = [k for k, z in _REGISTRY.items() if k != key and z.idle]
        for k in idle[:max(0, len(idle) - _MAX_IDLE)]:
            _REGISTRY.pop(k).close()
        return zygote


def _failed(key: tuple[tuple[str, str], ...], why: str) -> None:
    _FAILED[key] = why
    warnings.warn(f"sp-harness: the rank fork server did not start, so ranks start as fresh interpreters "
                  f"(seconds slower; {ENV_VAR}=0 says so without trying): {why}", RuntimeWarning, stacklevel=3)


def close_idle() -> None:
    """Closes the zygotes no rank process uses (PoolManager.close: a pytest-xdist worker closes its
    pools before it reports itself finished, and may be SIGKILLed soon after)."""
    with _REGISTRY_LOCK:
        for key in [k for k, z in _REGISTRY.items() if z.idle]:
            _REGISTRY.pop(key).close()


def close_all() -> None:
    """Closes every zygote of this process (at exit), and the ranks they forked."""
    with _REGISTRY_LOCK:
        zygotes = list(_REGISTRY.values())
        _REGISTRY.clear()
    for zygote in zygotes:
        zygote.close()


def _forget_after_fork() -> None:
    # a forked copy of the driver shares the parent's pipes: the zygotes are the parent's to use
    _REGISTRY.clear()
    _FAILED.clear()


# registered at import, before any PoolManager's: runs after their close (atexit runs in reverse)
atexit.register(close_all)
os.register_at_fork(after_in_child=_forget_after_fork)


# ---------------------------------------------------------------- the zygote process


def _preload() -> None:
    """What every rank (and companion) would otherwise import itself; no op is run (module docstring)."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (a module's first construction imports it: seconds)
    import torch.distributed  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401  (DTensor, sympy)

    import sp_harness.launch.companion  # noqa: F401
    import sp_harness.launch.worker  # noqa: F401
    from sp_harness.config.registry import all_cases

    all_cases()


def _serve(conn: Connection) -> tuple | None:
    """The zygote's loop: fork a rank per request, report each child's exit. Returns None when the
    driver is gone; in a forked child, returns its request (the caller becomes the rank)."""
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    # SIGCHLD wakes the select: a rank's exit is reported as it happens, not at the next request
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: set[int] = set()
    pipe = conn.fileno()
    try:
        while True:
            readable, _, _ = select.select([pipe, wake_r], [], [])
            if wake_r in readable:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
            _reap(conn, children)
            if pipe not in readable:
                continue
            try:
                _, request, args = conn.recv()
            except (EOFError, OSError):
                return None
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError:
                conn.send(("spawn_failed", request, traceback.format_exc()))
                continue
            if pid == 0:
                # the rank: none of the zygote's pipes or signal handling comes along
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.close(wake_r)
                os.close(wake_w)
                conn.close()
                return (*args, me)
            children.add(pid)
            conn.send(("spawned", request, pid))
    except OSError:  # the driver's end closed while we wrote to it
        return None
    finally:
        if os.getpid() == me:
            for pid in children:
                for kill in (os.killpg, os.kill):  # a rank not yet in its own session: killpg misses it
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass


def _reap(conn: Connection, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        conn.send(("exited", pid, status))


def _become_rank(spec_json: str, log_path: str, env: dict[str, str], cwd: str, zygote_pid: int) -> None:
    """In a forked child: set up as `subprocess.Popen` set up a rank, then run it."""
    os.setsid()  # the pool's killpg takes the rank and everything it starts
    _set_pdeathsig()
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


def _main(fd: int, driver_pid: int, deathsig: bool) -> tuple | None:
    if deathsig:
        _set_pdeathsig()
        if os.getppid() != driver_pid:
            return None  # the driver died before the death signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    conn = Connection(fd)
    try:
        _preload()
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return None
    # the imports' objects leave the collector's reach: a collection in a rank would write to each
    # of them (its gc links) and so copy the zygote's pages into every rank
    gc.freeze()
    conn.send(("ready", os.getpid()))
    return _serve(conn)


if __name__ == "__main__":
    _request = _main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
    if _request is None:
        sys.stdout.flush()
        os._exit(0)  # nothing to finalize: its temp dir is the driver's to remove
    _become_rank(*_request)
