"""Stage: launch. A persistent pool of real torch.distributed ranks that serves many jobs.

Spawning ranks per example costs seconds (process start, torch import, rendezvous); a pool pays
that once per world size and then runs each job in milliseconds. The default process group of a
pool is exactly the job's world, so a collective that forgets `group=` behaves as it would in
production (it runs over the whole world), which a pool carved into subgroups could not show.

Rendezvous uses a TCPStore hosted by the driver on an OS-chosen port, so pools in concurrent
pytest-xdist workers never collide; start-up has its own budget (sp_harness.launch.rank_start).
Each job has a timeout, a hard cap; a rank that raises, hangs, exits or is killed by a signal
becomes a `RankFailure` (sp_harness.launch.failure) naming the job label (case and config), each
failing rank, what happened to it and its traceback or Python stack (sp_harness.launch.rank_probe),
and the pool is torn down and rebuilt on next use. A job is hung when its ranks make no progress,
not when it is slow: its wait ends (a `RankFailure` whose `rule` says which rule fired) once no rank
has moved for seconds, or past a cap its own first step sets (sp_harness.launch.activity.Liveness),
well before a generous timeout. A desync (ranks whose collectives cannot pair up)
is found while the job runs (sp_harness.launch.replies), within seconds rather than at the
timeout. On Linux each rank is forked from a fork server that has imported torch once
(sp_harness.launch.zygote: milliseconds, where a fresh interpreter took seconds);
SP_HARNESS_FORKSERVER=0 starts fresh ones. Rank processes (sp_harness.launch.worker) die with the
driver, so nothing is left running after success, failure, timeout or Ctrl-C; the pool's scratch
directory (stack dumps, rank logs) goes with `close()`, which also runs at exit. A process's pools
by world size are sp_harness.launch.manager's.

Under `torchrun` there is no driver: `TorchrunWorld` (sp_harness.launch.torchrun) runs jobs
in-process behind the same `run` interface.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Listener
from typing import TYPE_CHECKING, Any, TypeVar

from sp_harness.launch import zygote_registry
from sp_harness.launch.activity import Liveness
from sp_harness.launch.case_setup import SETUP_TIMEOUT_S
from sp_harness.launch.desync import DesyncWatch
from sp_harness.launch.failure import RankError, RankFailure, SetupError
from sp_harness.launch.rank_probe import RankProbe, rank_path
from sp_harness.launch.rank_start import await_ready, connect, import_path, spawn_rank
from sp_harness.launch.replies import collect
from sp_harness.launch.scratch import ScratchDir, sweep_orphans
from sp_harness.launch.wire import Job, JobDone, PoolOptions, Shutdown, WorkerSpec, job_ref
from sp_harness.launch.worker import START_TIMEOUT_S, health_check, run_setup, warm_up
from sp_harness.launch.zygote import RankProcess

if TYPE_CHECKING:
    from torch.distributed import TCPStore

P = TypeVar("P")
R = TypeVar("R")


def _hang(label: str, hung: list[RankError], live: Liveness, watch: DesyncWatch) -> RankFailure:
    """The hang of ranks `hung`, still pending when `live` ended the wait: its rule leads the message."""
    elapsed = round(live.fired_at - live.start, 1)
    if live.fired == "cap":
        return RankFailure(label, hung, elapsed, rule=live.cap_text())
    hung = [dataclasses.replace(e, detail=_idle_where(e, watch)) if e.kind == "timeout" else e for e in hung]
    # the culprits (asleep elsewhere) first, then the ranks blocked waiting for them
    said = "; ".join(f"rank {e.rank} {e.detail}" for e in sorted(hung, key=lambda e: e.blocked_in_collective))
    return RankFailure(label, hung, elapsed, rule=f"no progress for {live.quiet_s:.0f} s ({said})")


def _idle_where(error: RankError, watch: DesyncWatch) -> str:
    """Where an idle rank is: outside any collective, or blocked in one; in its last announced
    one where a peer of that group never announced it (announcements precede the issue, so that
    peer never entered it), else in one the announcements do not show."""
    if not error.traceback:
        return "asleep (no stack available)"
    where = "asleep outside any collective" if not error.blocked_in_collective else "blocked in a collective"
    last = watch.last(error.rank)
    if error.blocked_in_collective and last is not None and last.group:
        members = watch.sequences.get(last.group, {})
        behind = [r for r in last.group if r != error.rank and len(members.get(r, ())) <= last.group_index]
        if behind:
            where = (f"blocked in {last.kind} #{last.group_index} on ranks {','.join(map(str, last.group))}, "
                     f"which rank(s) {', '.join(map(str, behind))} never entered")
    return where


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class RankPool:
    """`world_size` rank processes with a live default process group, serving jobs."""

    def __init__(self, world_size: int, options: PoolOptions = PoolOptions()):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.options = options
        self._procs: list[subprocess.Popen | RankProcess] = []
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

    def _probes(self) -> list[RankProbe]:
        assert self._tmpdir is not None, "the pool is not running"
        return [RankProbe(rank=rank, proc=proc, folder=self._tmpdir) for rank, proc in enumerate(self._procs)]

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
        self._tmpdir = folder = scratch.path
        # removed by close(), or at interpreter exit for a pool nobody closed
        self._remove_tmpdir = weakref.finalize(self, scratch.remove)
        # the ranks' (and their reference processes') temporary files go into the pool's own folder,
        # removed by close(): a framework that makes temp dirs at import (wandb, under torchtitan)
        # and a rank killed before its own cleanup leave nothing in the machine's /tmp
        env = dict(_inherited_environ(), SP_HARNESS_AUTHKEY=authkey.hex(), TMPDIR=folder, **dict(self.options.env))
        try:
            # ranks forked from a process that has imported torch (sp_harness.launch.zygote):
            # milliseconds each, where a fresh interpreter takes seconds
            forks = zygote_registry.for_env(env, START_TIMEOUT_S) if zygote_registry.enabled() else None
            for rank in range(self.world_size):
                spec = WorkerSpec(rank=rank, world_size=self.world_size, store_port=store.port,
                                  address=(listener.address[0], listener.address[1]),
                                  stack_path=rank_path(folder, rank, "stack.txt"),
                                  fatal_path=rank_path(folder, rank, "fatal.txt"), options=self.options,
                                  sys_path=tuple(import_path()))
                proc, log = spawn_rank(spec, log_path=rank_path(folder, rank, "log"), env=env, forks=forks)
                self._procs.append(proc)
                if log is not None:
                    self._logs.append(log)
            deadline = time.monotonic() + START_TIMEOUT_S
            self._conns = [None] * self.world_size
            connect(listener, self._conns, self._probes(), deadline, label)
            await_ready(self._conns, self._probes(), deadline, label)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self.num_starts += 1
        # start-up has its own budget: a job's --timeout measures the job, not the imports
        self._run(warm_up, None, timeout_s=START_TIMEOUT_S, label=label + " (warm-up)")
        self.start_s = time.monotonic() - self._started_at

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
        return self._run(fn, payload, timeout_s=timeout_s, label=label, progress=progress, judge_progress=True)

    def _run_setup(self, case: str, label: str, progress: Callable[[str], None] | None) -> None:
        if progress:
            progress(f"setting up {case} on {self.world_size} ranks...")
        try:
            self._run(run_setup, case, timeout_s=SETUP_TIMEOUT_S, label=label + " (setup)")
        except RankFailure as exc:
            raise SetupError.of(case, exc) from exc
        self.set_up.add(case)

    def _run(self, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
             progress: Callable[[str], None] | None = None, judge_progress: bool = False) -> list[R]:
        """`judge_progress`: the wait also ends when the ranks make no progress or run past the
        cap their first step sets (a job's own). Start-up and a case's setup keep their flat
        budgets: neither is the code under test, and a setup may wait without using the CPU (on
        a download, another process's lock)."""
        fn_ref = job_ref(fn)
        self._job_id += 1
        for conn in self._conns:
            conn.send(Job(job_id=self._job_id, fn_ref=fn_ref, payload=payload))
        probes = self._probes()
        live = Liveness(start=time.monotonic(), timeout_s=timeout_s) if judge_progress else None
        got = collect(self._conns, probes, job_id=self._job_id, timeout_s=timeout_s, progress=progress, live=live)
        if got.desync:
            # the desynced ranks are blocked or about to fail: say where they are, then rebuild
            found = [dataclasses.replace(e, traceback=probes[e.rank].stack_now()) if e.rank in got.pending else e
                     for e in got.desync]
            found = [dataclasses.replace(e, phase=got.phases.get(e.rank, "")) for e in found]
            self.close()
            raise RankFailure(label, found + got.errors)
        if not got.pending and not got.errors:
            return [got.results[r] for r in range(self.world_size)]
        # a hang on the others is a consequence of an error: report the root cause only
        hung = [] if got.errors else [dataclasses.replace(probes[r].hung(), phase=got.phases.get(r, ""))
                                      for r in sorted(got.pending)]
        every_rank_raised = not got.pending and all(e.kind == "raised" for e in got.errors) and self.alive
        if not (every_rank_raised and self._healthy()):
            self.close()  # the process group's state is unknown: rebuild on next use
        if got.errors:
            raise RankFailure(label, got.errors)
        if live is not None and live.fired:
            raise _hang(label, hung, live, got.watch)
        raise RankFailure(label, hung, timeout_s)

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


def _inherited_environ() -> dict[str, str]:
    """This process's environment as its ranks inherit it, less what torch wrote into it itself.

    torch's inductor writes its default cache folder into os.environ at first use
    (torch._inductor.runtime.cache_dir_utils.cache_dir; `import torch._dynamo` is enough, and a
    torch optimizer's first step imports it). Inherited, that value would put the ranks' compiled
    kernels in the driver's /tmp/torchinductor_USER instead of their pool's own TMPDIR, override a
    case's own cache (torchtitan's FlexAttention `use_inductor_cache` only sets a default), and,
    appearing between two pools, key a second zygote for the same ranks. A value other than
    torch's default (a user's own) is inherited."""
    env = dict(os.environ)
    value = env.get(INDUCTOR_CACHE_ENV)
    if value is not None:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:  # another torch's layout: inherit it, as before
            return env
        if os.path.abspath(value) == os.path.abspath(default_cache_dir()):
            del env[INDUCTOR_CACHE_ENV]
    return env
