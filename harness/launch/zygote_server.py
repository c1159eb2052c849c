"""Stage: launch. The fork server ("zygote") process: it imports torch and the rank's modules once,
then forks a rank per request from the driver and reports how each one ends.

Before it forks, the zygote must not run a torch op (a preload's scalar tensors aside:
PRELOAD_ENV) or start a thread. torch fixes its CPU kernel
family (ATEN_CPU_CAPABILITY) at the first dispatched op, and a parallel op starts OpenMP's thread
pool, which a forked child cannot use; a fork copies only the forking thread, so a lock another
thread held stays locked in the child. (numpy's OpenBLAS starts threads at import, and stops them
in its own pthread_atfork handler: the zygote is single-threaded at each fork.) The built-in
cases are imported too: their import dispatches no op, starts no thread and makes no folder, and
it saves each rank and companion their own import. So are the modules a pool's case declares
(`Case.preload`, passed as SP_HARNESS_PRELOAD in the pool's environment, which also keys the
zygote: a framework's pools get a zygote of their own, which holds the framework's import).

The protocol, over the socket the driver passed it (sp_harness.launch.zygote is the other end):
once, the zygote sends ("ready", pid) or ("failed", traceback); then for each ("spawn", request,
(spec_json, log_path, env, cwd)) the driver sends, it answers ("spawned", request, pid) or
("spawn_failed", request, traceback), and for each child that ends, ("exited", pid, wait status):
the driver is not a rank's parent, so the zygote reaps them. The zygote dies with the driver
(PR_SET_PDEATHSIG where the driver started it from its main thread, and EOF on its pipe); when
the pipe closes it kills the process groups of the ranks it forked. A forked child returns from
the serve loop and becomes a rank (sp_harness.launch.zygote_child).
"""

from __future__ import annotations

import gc
import os
import select
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from sp_harness.launch.case_setup import load_preload
from sp_harness.launch.zygote_child import become_rank, set_pdeathsig

PRELOAD_ENV = "SP_HARNESS_PRELOAD"
"""The case's `preload` entries, comma-separated (sp_harness.launch.manager sets it per pool).

CPU (gloo) pools only: a framework's import may ask CUDA about its devices (torchtitan's does),
and a rank forked after CUDA is initialised cannot use it; a GPU pool's ranks import the
framework themselves (the case's `setup`). Some of these imports make a tensor from a Python
scalar at their top level (torch's pipelining, which torchtitan imports; megatron's
multi-token prediction): `aten::lift_fresh`, `aten::detach_`, `aten::empty` and `aten::to` on
one element. None runs a parallel region (OpenMP's threads stay unstarted: the zygote stays
single-threaded, tested), and they run on the kernel family of the zygote's environment, which
is its ranks' (the environment keys the zygote). An import that initialises CUDA fails the
zygote, and the pool starts its ranks as fresh interpreters."""

SCALAR_TENSOR_OPS = frozenset({"aten::lift_fresh", "aten::detach_", "detach_", "aten::empty", "aten::to",
                               "aten::expm1", "aten::log", "aten::clamp_min", "aten::item", "aten::_local_scalar_dense"})
"""The ops a preload may dispatch (above): a tensor made from a Python scalar, and tensordict's
(which verl imports) inverse softplus of its bias, computed at import on that one-element tensor
(tensordict.nn.utils): one element is never a parallel region."""

ARROW_JEMALLOC_ENV = ("JE_ARROW_MALLOC_CONF", "background_thread:false")
"""pyarrow's bundled jemalloc starts a background purging thread when its library loads (the HF
Trainer imports datasets, which imports pyarrow), and a fork server must not hold a thread: the
zygote turns that thread off (a user's own setting of the variable stands). It only decides when
freed pages go back to the OS, never a value; forked ranks inherit it."""


def _threads() -> int | None:
    """This process's OS thread count (Linux /proc), None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return None


def _preload() -> None:
    """What every rank (and companion) would otherwise import itself; no op is run (module docstring)."""
    os.environ.setdefault(*ARROW_JEMALLOC_ENV)  # before any import loads pyarrow's library
    import torch
    import torch._dynamo  # noqa: F401  (a module's first construction imports it: seconds)
    import torch.distributed  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401  (DTensor, sympy)

    import sp_harness.launch.companion  # noqa: F401
    import sp_harness.launch.worker  # noqa: F401
    from sp_harness.config.registry import all_cases

    all_cases()
    # before the case's preload: numpy's OpenBLAS threads (stopped at each fork, module doc) are
    # counted here, so only a thread the case's imports start is the case's
    before = _threads()
    load_preload(filter(None, os.environ.get(PRELOAD_ENV, "").split(",")))
    after = _threads()
    if before is not None and after is not None and after > before:
        raise RuntimeError(f"{PRELOAD_ENV}={os.environ.get(PRELOAD_ENV)!r} started {after - before} thread(s): a "
                           f"fork would copy a lock another thread holds")
    if torch.cuda.is_initialized():
        raise RuntimeError(f"{PRELOAD_ENV}={os.environ.get(PRELOAD_ENV)!r} initialised CUDA: a forked rank "
                           f"could not use it")


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


def _main(fd: int, driver_pid: int, deathsig: bool) -> tuple | None:
    if deathsig:
        set_pdeathsig()
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
    become_rank(*_request)
