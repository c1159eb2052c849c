"""Stage: launch ranks. A persistent pool of real torch.distributed ranks that serves many jobs.

Spawning ranks per example costs seconds (process start, torch import, rendezvous); a pool pays
that once per world size and then runs each job in milliseconds. The default process group of a
pool is exactly the job's world, so a collective that forgets `group=` behaves as it would in
production (it runs over the whole world), which a pool carved into subgroups could not show.

Rendezvous uses a TCPStore hosted by the driver on an OS-chosen port, so pools in concurrent
pytest-xdist workers never collide. Each job has a timeout; a rank that raises, hangs or desyncs
becomes a `RankFailure` naming the job label (case and config), the rank and its traceback (for a
hang: the rank's Python stack, dumped by faulthandler), and the pool is torn down and rebuilt on
next use. Workers die with the driver (PR_SET_PDEATHSIG on Linux, EOF on their pipe otherwise),
so nothing is left running after success, failure, timeout or Ctrl-C.

Under `torchrun` there is no driver: `TorchrunWorld` runs jobs in-process on the env:// world and
gathers the results on every rank, behind the same `run` interface.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import datetime
import faulthandler
import importlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from multiprocessing.connection import wait as wait_conns
from typing import Any

_START_TIMEOUT_S = 120.0
# after one rank fails, how long the others get to report before they count as hung
_FAILURE_GRACE_S = 2.0


class RankFailure(Exception):
    """A job failed on one or more ranks: raised, timed out, or the rank process died."""

    def __init__(self, label: str, kind: str, failures: dict[int, str], *, timeout_s: float | None = None):
        self.label = label
        self.kind = kind
        self.failures = dict(failures)  # callers order them: root cause first
        self.timeout_s = timeout_s
        super().__init__(self.describe())

    @property
    def first_rank(self) -> int:
        return next(iter(self.failures))

    @property
    def waiting(self) -> list[int]:
        """Hung ranks that are only blocked in a collective, waiting for the culprits."""
        return [r for r, text in self.failures.items() if _in_collective(text)]

    @property
    def culprits(self) -> list[int]:
        blocked = set(self.waiting)
        return [r for r in self.failures if r not in blocked] or list(self.failures)

    def describe(self, *, with_traces: bool = True) -> str:
        ranks = ", ".join(map(str, self.failures))
        if self.kind == "timeout":
            culprits = self.culprits
            head = f"{self.label}: timed out after {self.timeout_s:g}s; rank(s) {', '.join(map(str, culprits))} did not finish"
            waiting = [r for r in self.failures if r not in culprits]
            if waiting:
                head += f" (rank(s) {', '.join(map(str, waiting))} blocked in a collective, waiting for them)"
        elif self.kind == "died":
            head = f"{self.label}: rank process(es) {ranks} died"
        else:
            head = f"{self.label}: rank(s) {ranks} raised"
        if not with_traces:
            return head
        parts = [head]
        for rank, text in self.failures.items():
            parts.append(f"--- rank {rank} ---\n{text.rstrip()}")
        return "\n".join(parts)

    def summary_line(self) -> str:
        """The exception (last traceback line), or for a hang the culprit's innermost frame."""
        if self.kind == "timeout":
            text = self.failures[self.culprits[0]]
            frames = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File ")]
            return f"rank {self.culprits[0]} at {frames[0]}" if frames else "no stack available"
        text = self.failures[self.first_rank].strip().splitlines()
        return text[-1] if text else self.kind


def _in_collective(stack: str) -> bool:
    """Whether a faulthandler dump's innermost frames (listed first) are inside a collective."""
    frames = [ln for ln in stack.splitlines() if ln.strip().startswith("File ")][:4]
    return any("torch/distributed" in ln or "c10d" in ln for ln in frames)


class JobError(Exception):
    """Raised inside a rank to report a failure whose traceback is noise (a clean message)."""


@dataclass(kw_only=True, frozen=True)
class PoolOptions:
    backend: str = "gloo"
    """'gloo' on CPU, 'nccl' when each rank has its own GPU."""
    devices: tuple[int, ...] | None = None
    """GPU index per rank for nccl; None on CPU."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for the rank processes, e.g. (("ATEN_CPU_CAPABILITY", "avx2"),): torch
    reads its kernel family at import, so a pool is how one process runs another CPU's kernels."""
    num_threads: int | None = None
    """torch intra-op threads per rank; None: OMP_NUM_THREADS where set (how a user varies the
    intra-op split, and with it reduction order), else 1, which keeps ranks off each other's cores."""


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _resolve(fn_ref: str):
    module, _, name = fn_ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _import_path() -> list[str]:
    """The driver's import path, absolute: what its case files and their imports resolve against
    (pytest's `pythonpath`, a src layout, the directory of a user's case file)."""
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


def _worker_main(spec: dict) -> None:
    _set_pdeathsig()
    # ranks import what the driver would: its path first, before any case module is loaded
    sys.path[:] = spec["sys_path"] + [p for p in sys.path if p not in spec["sys_path"]]
    rank, world_size, port = spec["rank"], spec["world_size"], spec["store_port"]
    options, stack_path = PoolOptions(**spec["options"]), spec["stack_path"]
    if options.devices is not None:
        options = dataclasses.replace(options, devices=tuple(options.devices))
    conn = Client(tuple(spec["address"]), authkey=bytes.fromhex(os.environ["SP_HARNESS_AUTHKEY"]))
    conn.send(rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    import torch
    import torch.distributed as dist

    threads = options.num_threads
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else 1
    torch.set_num_threads(threads)
    if options.devices is not None:
        torch.cuda.set_device(options.devices[rank])
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=_START_TIMEOUT_S))
        dist.init_process_group(options.backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        job_id, fn_ref, payload = msg
        try:
            result = _resolve(fn_ref)(payload)
            conn.send((job_id, "ok", result))
        except JobError as exc:
            conn.send((job_id, "error", f"{type(exc).__name__}: {exc}"))
        except BaseException as exc:
            conn.send((job_id, "error", traceback.format_exc(), type(exc).__name__))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def health_check(_: object = None) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


class RankPool:
    """`world_size` rank processes with a live default process group, serving jobs."""

    def __init__(self, world_size: int, options: PoolOptions = PoolOptions()):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.options = options
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Any] = []
        self._stack_paths: list[str] = []
        self._logs: list[Any] = []
        self._job_id = 0
        self.num_starts = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        import torch.distributed as dist

        self.close()
        # the driver hosts the store on an OS-chosen port: no fixed ports, no xdist collisions
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True,
                                    wait_for_workers=False)
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        tmp = tempfile.mkdtemp(prefix="sp-harness-stacks-")
        env = dict(os.environ, SP_HARNESS_AUTHKEY=authkey.hex(), **dict(self.options.env))
        for rank in range(self.world_size):
            path = os.path.join(tmp, f"rank{rank}.txt")
            self._stack_paths.append(path)
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
            self._logs.append(log)
            spec = json.dumps({"rank": rank, "world_size": self.world_size, "store_port": self._store.port,
                               "address": list(listener.address), "stack_path": path,
                               "options": dataclasses.asdict(self.options), "sys_path": _import_path()})
            # a plain subprocess, not multiprocessing's spawn: spawn re-imports the caller's
            # __main__, which a library must not require to be import-safe
            # rank output goes to a per-rank log; its tail is attached to failures (a C++ abort
            # such as gloo's size-mismatch enforce is only ever printed there)
            self._procs.append(subprocess.Popen([sys.executable, "-m", "sp_harness.launch.pool", spec], env=env,
                                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        self._conns = [None] * self.world_size
        deadline = time.monotonic() + _START_TIMEOUT_S
        listener._listener._socket.settimeout(1.0)
        try:
            while any(c is None for c in self._conns):
                if time.monotonic() > deadline:
                    raise RankFailure(f"starting {self.world_size} ranks", "timeout",
                                      {r: "did not connect" for r, c in enumerate(self._conns) if c is None},
                                      timeout_s=_START_TIMEOUT_S)
                dead = {r: f"exited with code {p.returncode} during start" for r, p in enumerate(self._procs)
                        if p.poll() is not None}
                if dead:
                    raise RankFailure(f"starting {self.world_size} ranks", "died", dead)
                try:
                    conn = listener.accept()
                except (socket.timeout, TimeoutError):
                    continue
                rank = conn.recv()
                self._conns[rank] = conn
            for rank, conn in enumerate(self._conns):
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise RankFailure(f"starting {self.world_size} ranks", "timeout",
                                      {rank: "rendezvous did not complete"}, timeout_s=_START_TIMEOUT_S)
                status, info = conn.recv()
                if status != "ready":
                    raise RankFailure(f"starting {self.world_size} ranks", "raised", {rank: info})
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        self.num_starts += 1

    def run(self, fn_ref: str, payload: Any, *, timeout_s: float, label: str) -> list[Any]:
        """Run `fn_ref(payload)` ("module:function") on every rank; results indexed by rank."""
        if not self.alive:
            self.start()
        self._job_id += 1
        job_id = self._job_id
        for conn in self._conns:
            conn.send((job_id, fn_ref, payload))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            if errors:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            ready = wait_conns(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = self._conns.index(conn)
                del pending[rank]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].wait(timeout=5)
                    code = self._procs[rank].poll()
                    errors[rank] = (f"rank process exited (exit code {code}) without a result; "
                                    f"last lines of its output:\n{self._log_tail(rank)}")
                    continue
                if msg[1] == "ok":
                    results[rank] = msg[2]
                else:
                    errors[rank] = msg[2]
        if not pending and not errors:
            return [results[r] for r in range(self.world_size)]
        hung = {r: self._dump_stack(r) for r in pending}
        every_rank_raised = not pending and len(errors) == self.world_size and self.alive
        if not (every_rank_raised and self._healthy()):
            self.close()  # the process group's state is unknown: rebuild on next use
        if errors:
            kind = "died" if all("without a result" in e for e in errors.values()) else "raised"
            # a rank that died explains the others' 'connection reset': list it first
            errors = dict(sorted(errors.items(), key=lambda kv: ("without a result" not in kv[1], kv[0])))
            # a hang on the others is a consequence of the raise: report the root cause only
            raise RankFailure(label, kind, errors)
        raise RankFailure(label, "timeout", dict(sorted(hung.items())), timeout_s=timeout_s)

    def _healthy(self) -> bool:
        """After every rank raised (none hung, none died) no rank can be inside a collective; a
        barrier confirms the group still pairs up, which saves a restart (seconds)."""
        self._job_id += 1
        try:
            for conn in self._conns:
                conn.send((self._job_id, "sp_harness.launch.pool:health_check", None))
            for conn in self._conns:
                if not conn.poll(5.0):
                    return False
                msg = conn.recv()
                if msg[0] != self._job_id or msg[1] != "ok":
                    return False
        except (OSError, EOFError):
            return False
        return True

    def _log_tail(self, rank: int, num_lines: int = 12) -> str:
        try:
            with open(self._logs[rank].name, errors="replace") as f:
                rows = [r for r in f.read().splitlines() if r.strip()]
        except OSError:
            return "(no output)"
        return "\n".join(rows[-num_lines:]) or "(no output)"

    def _dump_stack(self, rank: int) -> str:
        proc = self._procs[rank]
        if proc.poll() is not None:
            return f"rank process exited (exit code {proc.returncode})"
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.3)
            with open(self._stack_paths[rank]) as f:
                stack = f.read().strip()
        except OSError:
            stack = ""
        return "hung; its Python stack at the timeout:\n" + stack if stack else "hung (no stack available)"

    def close(self) -> None:
        for conn in self._conns:
            try:
                if conn is not None:
                    conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        for log in self._logs:
            log.close()
        self._procs, self._conns, self._stack_paths, self._logs = [], [], [], []
        self._store = None


class PoolManager:
    """Pools by world size, started lazily, the least recently used closed beyond `max_pools`."""

    def __init__(self, options: PoolOptions = PoolOptions(), *, max_pools: int = 3):
        self.options = options
        self.max_pools = max_pools
        self._pools: OrderedDict[int, RankPool] = OrderedDict()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def get(self, world_size: int) -> RankPool:
        with self._lock:
            pool = self._pools.pop(world_size, None)
            if pool is None:
                pool = RankPool(world_size, self.options)
            self._pools[world_size] = pool
            while len(self._pools) > self.max_pools:
                _, old = self._pools.popitem(last=False)
                old.close()
            return pool

    def run(self, world_size: int, fn_ref: str, payload: Any, *, timeout_s: float, label: str) -> list[Any]:
        return self.get(world_size).run(fn_ref, payload, timeout_s=timeout_s, label=label)

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()


class TorchrunWorld:
    """The torchrun (env://) world as a pool: every rank runs every job in-process (SPMD)."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()

    def run(self, world_size: int, fn_ref: str, payload: Any, *, timeout_s: float, label: str) -> list[Any]:
        import torch.distributed as dist

        if world_size != self.world_size:
            raise ValueError(f"torchrun world has {self.world_size} ranks, the job asks for {world_size}")
        try:
            result: Any = ("ok", _resolve(fn_ref)(payload))
        except Exception:
            result = ("error", traceback.format_exc())
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, result)
        errors = {r: g[1] for r, g in enumerate(gathered) if g[0] == "error"}
        if errors:
            raise RankFailure(label, "raised", errors)
        return [g[1] for g in gathered]

    def close(self) -> None:
        pass


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                     and "MASTER_ADDR" in os.environ)


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))
