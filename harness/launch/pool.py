"""Stage: launch. A persistent pool of real torch.distributed ranks that serves many jobs.

Spawning ranks per example costs seconds (process start, torch import, rendezvous); a pool pays
that once per world size and then runs each job in milliseconds. The default process group of a
pool is exactly the job's world, so a collective that forgets `group=` behaves as it would in
production (it runs over the whole world), which a pool carved into subgroups could not show.

Rendezvous uses a TCPStore hosted by the driver on an OS-chosen port, so pools in concurrent
pytest-xdist workers never collide. Each job has a timeout; a rank that raises, hangs, exits or
is killed by a signal becomes a `RankFailure` (sp_harness.launch.failure) naming the job label
(case and config), each failing rank, what happened to it and its traceback or Python stack, and
the pool is torn down and rebuilt on next use. A desync (ranks whose collectives cannot pair up)
is found from the collectives the ranks announce while the job runs (sp_harness.launch.desync),
within seconds rather than at the timeout. On Linux each rank is forked from a fork server that
has imported torch once (sp_harness.launch.zygote: milliseconds, where a fresh interpreter took
seconds); SP_HARNESS_FORKSERVER=0 starts fresh ones. Rank processes (sp_harness.launch.worker) die with
the driver, so nothing is left running after success, failure, timeout or Ctrl-C; the pool's
scratch directory (stack dumps, rank logs) goes with `close()`, which also runs at exit.

Under `torchrun` there is no driver: `TorchrunWorld` (sp_harness.launch.torchrun) runs jobs
in-process behind the same `run` interface.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from multiprocessing.connection import wait as wait_conns
from typing import TYPE_CHECKING, Any, TypeVar

from sp_harness.config.case import SHARED_PROCESSES, isolation_key
from sp_harness.config.registry import get_case
from sp_harness.launch import zygote
from sp_harness.launch.activity import stopped
from sp_harness.launch.case_setup import SETUP_TIMEOUT_S
from sp_harness.launch.desync import DesyncWatch
from sp_harness.launch.failure import (
    JobError,
    RankError,
    RankFailure,
    SetupError,
    process_ended,
    raised,
    stack_frames,
    waiting_in_collective,
)
from sp_harness.launch.scratch import ScratchDir, sweep_orphans
from sp_harness.launch.torchrun import TorchrunWorld, under_torchrun
from sp_harness.launch.wire import (
    CollectiveIssued,
    Hello,
    Job,
    JobDone,
    JobRaised,
    PoolOptions,
    Progress,
    Ready,
    Shutdown,
    StartFailed,
    WorkerSpec,
    job_ref,
)
from sp_harness.launch.worker import START_TIMEOUT_S, health_check, run_setup, warm_up

if TYPE_CHECKING:
    from torch.distributed import TCPStore

# re-exported: callers import the pool's whole surface from here
__all__ = ["JobError", "PoolManager", "PoolOptions", "RankError", "RankFailure", "RankPool", "SetupError",
           "TorchrunWorld", "under_torchrun"]

# after one rank fails, how long the others get to report before they count as hung
_FAILURE_GRACE_S = 2.0
# how often the wait loop looks for a stall, and how long every pending rank must have been
# silent before their stacks are sampled (a desync where counts differ: sp_harness.launch.desync)
_POLL_S = 0.5
_STALL_S = 2.0
P = TypeVar("P")
R = TypeVar("R")


@dataclass(kw_only=True)
class _Replies:
    """What came back for the current job so far."""

    pending: dict[int, Any]
    """Rank -> its pipe, for ranks that have not replied."""
    watch: DesyncWatch
    results: dict[int, Any] = field(default_factory=dict)
    errors: list[RankError] = field(default_factory=list)
    """In the order they came."""

    @property
    def desync(self) -> list[RankError]:
        return self.watch.found


def _import_path() -> list[str]:
    """The driver's import path, absolute: what its case files and their imports resolve against
    (pytest's `pythonpath`, a src layout, the directory of a user's case file)."""
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


_interrupt: BaseException | None = None


def interrupt_pending(exc: BaseException | None) -> None:
    """A signal handler's exception (KeyboardInterrupt, or the CLI's SIGTERM), kept until cleared
    with None: a handler's exception raised inside a `__del__` or a weakref callback is printed
    and swallowed by Python, and the driver would wait on its ranks forever; the wait loop raises
    it again at its next wake-up (within _POLL_S)."""
    global _interrupt
    _interrupt = exc


class RankPool:
    """`world_size` rank processes with a live default process group, serving jobs."""

    def __init__(self, world_size: int, options: PoolOptions = PoolOptions()):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.options = options
        self._procs: list[subprocess.Popen | zygote.RankProcess] = []
        self._conns: list[Any] = []
        self._logs: list[Any] = []
        self._tmpdir: str | None = None
        self._remove_tmpdir: weakref.finalize | None = None
        self._store: TCPStore | None = None
        self._job_id = 0
        self.set_up: set[str] = set()
        """Case names whose `setup` ran in the current rank processes."""
        self.num_starts = 0
        self.start_s = 0.0
        """Seconds the last start took, warm-up job included (reported, never a job's timeout)."""

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    @property
    def scratch_dir(self) -> str | None:
        """The running pool's directory of stack dumps and rank logs; None when closed."""
        return self._tmpdir

    def _path(self, rank: int, suffix: str) -> str:
        assert self._tmpdir is not None, "the pool is not running"
        return os.path.join(self._tmpdir, f"rank{rank}.{suffix}")

    def start(self) -> None:
        import torch.distributed as dist

        self.close()
        self.set_up = set()
        self._started_at = time.monotonic()
        label = f"starting {self.world_size} ranks"
        # the driver hosts the store on an OS-chosen port: no fixed ports, no xdist collisions
        self._store = store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True,
                                            wait_for_workers=False)
        authkey = secrets.token_bytes(16)
        # every rank connects at once: with the default backlog of 1 a connect beyond the queue
        # waits out the kernel's SYN retry backoff (1, 3, 7, ... s); an 8-rank start once lost a
        # rank that never connected within the start-up budget
        listener = Listener(("127.0.0.1", 0), backlog=self.world_size, authkey=authkey)
        # folders a SIGKILLed driver left behind go first (sp_harness.launch.scratch)
        sweep_orphans()
        scratch = ScratchDir()
        self._tmpdir = scratch.path
        # removed by close(), or at interpreter exit for a pool nobody closed
        self._remove_tmpdir = weakref.finalize(self, scratch.remove)
        # the ranks' (and their reference processes') temporary files go into the pool's own folder,
        # removed by close(): a framework that makes temp dirs at import (wandb, under torchtitan)
        # and a rank killed before its own cleanup leave nothing in the machine's /tmp
        env = dict(os.environ, SP_HARNESS_AUTHKEY=authkey.hex(), TMPDIR=self._tmpdir, **dict(self.options.env))
        try:
            # ranks forked from a process that has imported torch (sp_harness.launch.zygote):
            # milliseconds each, where a fresh interpreter takes seconds
            forks = zygote.for_env(env, START_TIMEOUT_S) if zygote.enabled() else None
            for rank in range(self.world_size):
                self._procs.append(self._spawn(rank, store.port, listener.address, env, forks))
            deadline = time.monotonic() + START_TIMEOUT_S
            self._connect(listener, deadline, label)
            self._await_ready(deadline, label)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self.num_starts += 1
        # start-up has its own budget: a job's --timeout measures the job, not the imports
        self._run(warm_up, None, timeout_s=START_TIMEOUT_S, label=label + " (warm-up)")
        self.start_s = time.monotonic() - self._started_at

    def _spawn(self, rank: int, store_port: int, address: tuple[str, int], env: dict[str, str],
               forks: zygote.Zygote | None) -> subprocess.Popen | zygote.RankProcess:
        spec = WorkerSpec(rank=rank, world_size=self.world_size, store_port=store_port, address=(address[0], address[1]),
                          stack_path=self._path(rank, "stack.txt"), fatal_path=self._path(rank, "fatal.txt"),
                          options=self.options, sys_path=tuple(_import_path()))
        if forks is not None:
            try:
                return forks.spawn(spec.to_json(), log_path=self._path(rank, "log"), env=env, cwd=os.getcwd())
            except zygote.ZygoteError:
                pass  # it died or could not fork: this rank starts as a fresh interpreter instead
        # rank output goes to a per-rank log; its tail is attached to failures (a C++ abort such
        # as gloo's size-mismatch enforce is only ever printed there)
        log = open(self._path(rank, "log"), "w")
        self._logs.append(log)
        # a plain subprocess, not multiprocessing's spawn: spawn re-imports the caller's __main__,
        # which a library must not require to be import-safe
        # its own session: a rank's children (its reference process, a compiler a framework starts)
        # are killed with it as one process group, and the terminal's Ctrl-C is the driver's alone
        return subprocess.Popen([sys.executable, "-m", "sp_harness.launch.worker", spec.to_json()], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _connect(self, listener: Listener, deadline: float, label: str) -> None:
        self._conns = [None] * self.world_size
        # wake up to notice ranks that died: accept() has no timeout of its own, so the private socket's
        # (typeshed does not declare Listener's private attributes)
        listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
        while any(c is None for c in self._conns):
            if time.monotonic() > deadline:
                raise RankFailure(label, [RankError(rank=r, kind="timeout", detail="did not connect")
                                          for r, c in enumerate(self._conns) if c is None], START_TIMEOUT_S)
            dead = [self._ended(r, detail="ended while starting") for r, p in enumerate(self._procs)
                    if p.poll() is not None]
            if dead:
                raise RankFailure(label, dead)
            try:
                conn = listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            hello = conn.recv()
            if not isinstance(hello, Hello):
                raise TypeError(f"rank process sent {hello!r} instead of Hello")
            self._conns[hello.rank] = conn

    def _await_ready(self, deadline: float, label: str) -> None:
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RankFailure(label, [RankError(rank=rank, kind="timeout", detail="rendezvous did not complete")],
                                  START_TIMEOUT_S)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                raise RankFailure(label, [self._ended(rank, detail="ended while starting")]) from None
            if isinstance(msg, StartFailed):
                raise RankFailure(label, [RankError(rank=rank, kind="raised", exc_type=msg.exc_type,
                                                    traceback=msg.traceback)])
            if not isinstance(msg, Ready):
                raise TypeError(f"rank {rank} sent {msg!r} instead of Ready")

    def run(self, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            progress: Callable[[str], None] | None = None, setup: str | None = None) -> list[R]:
        """Run `fn(payload)` on every rank (a module-level function: the ranks import it by name,
        sp_harness.launch.wire.job_ref); results indexed by rank.
        `progress`, if given, gets a line for a person as the pool starts and as rank 0 reports.
        `setup`: a case whose `Case.setup` runs first, once per rank process, on its own budget."""
        job_ref(fn)  # a job the ranks cannot import fails here, before any rank starts
        if not self.alive:
            if progress:
                progress(f"starting {self.world_size} ranks...")
            self.start()
            if progress:
                progress(f"started {self.world_size} ranks in {self.start_s:.1f}s")
        if setup is not None and setup not in self.set_up:
            self._run_setup(setup, label, progress)
        return self._run(fn, payload, timeout_s=timeout_s, label=label, progress=progress)

    def _run_setup(self, case: str, label: str, progress: Callable[[str], None] | None) -> None:
        if progress:
            progress(f"setting up {case} on {self.world_size} ranks...")
        try:
            self._run(run_setup, case, timeout_s=SETUP_TIMEOUT_S, label=label + " (setup)")
        except RankFailure as exc:
            raise SetupError.of(case, exc) from exc
        self.set_up.add(case)

    def _run(self, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
             progress: Callable[[str], None] | None = None) -> list[R]:
        fn_ref = job_ref(fn)
        self._job_id += 1
        for conn in self._conns:
            conn.send(Job(job_id=self._job_id, fn_ref=fn_ref, payload=payload))
        got = self._collect(timeout_s, progress)
        if got.desync:
            # the desynced ranks are blocked or about to fail: say where they are, then rebuild
            found = [dataclasses.replace(e, traceback=self._stack_now(e.rank)) if e.rank in got.pending else e
                     for e in got.desync]
            self.close()
            raise RankFailure(label, found + got.errors)
        if not got.pending and not got.errors:
            return [got.results[r] for r in range(self.world_size)]
        # a hang on the others is a consequence of an error: report the root cause only
        hung = [] if got.errors else [self._dump_stack(r) for r in sorted(got.pending)]
        every_rank_raised = not got.pending and all(e.kind == "raised" for e in got.errors) and self.alive
        if not (every_rank_raised and self._healthy()):
            self.close()  # the process group's state is unknown: rebuild on next use
        if got.errors:
            raise RankFailure(label, got.errors)
        raise RankFailure(label, hung, timeout_s)

    def _collect(self, timeout_s: float, progress: Callable[[str], None] | None) -> _Replies:
        """Replies to the current job, the ranks that did not answer in time (or within the grace
        period after an error), or a desync found in the collectives the ranks announced."""
        got = _Replies(pending=dict(enumerate(self._conns)), watch=DesyncWatch(stall_s=_STALL_S))
        now = time.monotonic()
        deadline = now + timeout_s
        for rank in range(self.world_size):
            got.watch.heard(rank, now)
        while got.pending and not got.watch.found:
            if _interrupt is not None:
                raise _interrupt  # a signal whose exception something swallowed on its way up
            if got.errors:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            # wake at least every _POLL_S to look for a stall while results are pending
            wait_s = min(_POLL_S, max(0.0, deadline - time.monotonic()))
            for conn in wait_conns(list(got.pending.values()), timeout=wait_s):
                self._receive(self._conns.index(conn), got, progress)
            now = time.monotonic()
            pending = set(got.pending)
            if got.watch.should_probe(pending, now):
                # a stack only from ranks that have stopped: a dump can crash a running one
                if stopped(self._procs[r].pid for r in pending):
                    stacks = {r: self._stack_now(r) for r in pending}
                    got.watch.probed(pending, {r for r in pending if waiting_in_collective(stacks[r])},
                                     {r: stack_frames(stack) for r, stack in stacks.items()})
                else:
                    got.watch.probed(pending, set())
            if now >= deadline:
                break
        return got

    def _receive(self, rank: int, got: _Replies, progress: Callable[[str], None] | None) -> None:
        """Take one message from `rank`: an announcement, progress, or its reply to the job."""
        conn = got.pending[rank]
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            del got.pending[rank]
            got.errors.append(self._ended(rank))
            return
        got.watch.heard(rank, time.monotonic())
        current = getattr(msg, "job_id", None) == self._job_id
        if isinstance(msg, CollectiveIssued) and current:
            got.watch.collective(rank, msg.collective)
        elif isinstance(msg, Progress) and current:
            if progress and rank == 0:  # ranks go in lockstep: one line per step is enough
                progress(f"{msg.what} {msg.done}/{msg.total}")
        elif isinstance(msg, JobDone) and current:
            del got.pending[rank]
            got.results[rank] = msg.result
            got.watch.done(rank)
        elif isinstance(msg, JobRaised) and current:
            del got.pending[rank]
            got.errors.append(raised(rank, msg))
        else:
            raise TypeError(f"rank {rank} sent {msg!r}, not a message of job {self._job_id}")

    def _ended(self, rank: int, *, detail: str = "") -> RankError:
        """The error for a rank whose process ended (its pipe closed) without a reply."""
        proc = self._procs[rank]
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return process_ended(rank, proc.poll(), stack=self._read(self._path(rank, "fatal.txt")),
                             log_tail=self._log_tail(rank), detail=detail)

    def _healthy(self) -> bool:
        """After every rank raised (none hung, none died) no rank can be inside a collective; a
        barrier confirms the group still pairs up, which saves a restart (seconds)."""
        self._job_id += 1
        try:
            for conn in self._conns:
                conn.send(Job(job_id=self._job_id, fn_ref=job_ref(health_check), payload=None))
            for conn in self._conns:
                if not conn.poll(5.0):
                    return False
                msg = conn.recv()
                if not (isinstance(msg, JobDone) and msg.job_id == self._job_id):
                    return False
        except (OSError, EOFError):
            return False
        return True

    def _read(self, path: str, offset: int = 0) -> str:
        try:
            with open(path, errors="replace") as f:
                f.seek(offset)
                return f.read().strip()
        except OSError:
            return ""

    def _log_tail(self, rank: int, num_lines: int = 12) -> str:
        rows = [r for r in self._read(self._path(rank, "log")).splitlines() if r.strip()]
        return "\n".join(rows[-num_lines:])

    def _dump_stack(self, rank: int) -> RankError:
        if self._procs[rank].poll() is not None:
            return self._ended(rank)
        stack = self._stack_now(rank)
        return RankError(rank=rank, kind="timeout", traceback=stack, detail="" if stack else "hung (no stack available)")

    def _stack_now(self, rank: int) -> str:
        """The rank's Python stack now (faulthandler on SIGUSR1), or its fatal-signal stack if it
        died; '' if neither. A rank may be asked more than once (a stall, then a timeout): its
        dumps append to one file, so only what this dump wrote is read."""
        proc = self._procs[rank]
        if proc.poll() is not None:
            return self._read(self._path(rank, "fatal.txt"))
        path = self._path(rank, "stack.txt")
        offset = os.path.getsize(path) if os.path.exists(path) else 0
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except OSError:
            return ""
        # faulthandler writes from the signal handler: wait until the dump stops growing
        stack, deadline = "", time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.1)
            latest = self._read(path, offset)
            if latest and latest == stack:
                break
            stack = latest
        return stack

    def request_shutdown(self) -> None:
        """Tells every rank to exit, without waiting: a manager tells all its pools first, so their
        ranks wind down together and close() waits about once, not once per pool."""
        for conn in self._conns:
            try:
                if conn is not None:
                    conn.send(Shutdown())
            except (OSError, BrokenPipeError):
                pass

    def close(self) -> None:
        self.request_shutdown()
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs:
            # the rank's whole process group: its reference process and whatever it started
            # (a compiler's children) end with it, whether the rank exited or hung
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        for log in self._logs:
            log.close()
        self._procs, self._conns, self._logs = [], [], []
        self._store = None
        if self._remove_tmpdir is not None:
            self._remove_tmpdir()  # runs once; detaches the at-exit hook
        self._tmpdir, self._remove_tmpdir = None, None


class PoolManager:
    """Pools by world size, started lazily, the least recently used closed beyond `max_pools`."""

    def __init__(self, options: PoolOptions = PoolOptions(), *, max_pools: int = 3):
        self.options = options
        self.max_pools = max_pools
        self._pools: OrderedDict[tuple[int, str], RankPool] = OrderedDict()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def get(self, world_size: int, isolation: str = SHARED_PROCESSES) -> RankPool:
        """The pool of `world_size` ranks for cases of isolation key `isolation`
        (sp_harness.config.case.isolation_key): a case that runs in processes of its own gets them."""
        key = (world_size, isolation)
        with self._lock:
            pool = self._pools.pop(key, None)
            if pool is None:
                pool = RankPool(world_size, self.options)
            self._pools[key] = pool
            while len(self._pools) > self.max_pools:
                _, old = self._pools.popitem(last=False)
                old.close()
            return pool

    def run(self, world_size: int, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            progress: Callable[[str], None] | None = None, case: str | None = None) -> list[R]:
        """Run `fn(payload)` on `world_size` ranks (see `RankPool.run`). `case`: the case the job runs, which picks the pool (its isolation) and whose setup runs
        first; None for jobs of no case (health checks, probes), on the shared pool."""
        if case is None:
            return self.get(world_size).run(fn, payload, timeout_s=timeout_s, label=label, progress=progress)
        spec = get_case(case)
        return self.get(world_size, isolation_key(spec)).run(
            fn, payload, timeout_s=timeout_s, label=label, progress=progress,
            setup=case if spec.setup is not None else None)

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.request_shutdown()
        for pool in pools:
            pool.close()
        # the fork servers no pool uses any more, and their temp dirs (sp_harness.launch.zygote)
        zygote.close_idle()
