"""Stage: launch. What travels between the driver and its rank processes.

The spawn spec goes to a rank as JSON on its command line; every later message is one of the
frozen dataclasses below, pickled over a multiprocessing.connection pipe. Both sides dispatch on
the message's type, never on its position in a tuple or on text inside it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


@dataclass(kw_only=True, frozen=True)
class WorkerSpec:
    """Everything a rank process needs to join its pool, passed as JSON on its command line."""

    rank: int
    world_size: int
    store_port: int
    """Port of the TCPStore the driver hosts for the rendezvous."""
    address: tuple[str, int]
    """Where the driver's Listener waits for this rank's job pipe."""
    stack_path: str
    """File the rank's faulthandler writes its all-thread stack to on SIGUSR1 (a hang)."""
    fatal_path: str
    """File the rank's faulthandler writes its stack to on a fatal signal (SIGSEGV, SIGABRT...)."""
    options: PoolOptions
    sys_path: tuple[str, ...]
    """The driver's import path, so ranks resolve case files and their imports as it does."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        opts = raw.pop("options")
        devices = opts.pop("devices")
        options = PoolOptions(devices=None if devices is None else tuple(devices),
                              env=tuple(tuple(kv) for kv in opts.pop("env")), **opts)
        return cls(options=options, address=tuple(raw.pop("address")), sys_path=tuple(raw.pop("sys_path")), **raw)


@dataclass(kw_only=True, frozen=True)
class Hello:
    """Rank -> driver, first message on a new pipe: which rank this pipe belongs to."""

    rank: int


@dataclass(kw_only=True, frozen=True)
class Ready:
    """Rank -> driver: the default process group is up; jobs may come."""


@dataclass(kw_only=True, frozen=True)
class StartFailed:
    """Rank -> driver: joining the process group raised."""

    exc_type: str
    traceback: str


@dataclass(kw_only=True, frozen=True)
class Job:
    """Driver -> rank: run `fn_ref(payload)` ("module:function", from `job_ref`)."""

    job_id: int
    fn_ref: str
    payload: Any


@dataclass(kw_only=True, frozen=True)
class JobDone:
    """Rank -> driver: the job returned `result`."""

    job_id: int
    result: Any


@dataclass(kw_only=True, frozen=True)
class JobRaised:
    """Rank -> driver: the job raised."""

    job_id: int
    exc_type: str
    """Class name of the exception, e.g. 'RuntimeError'."""
    traceback: str
    """The formatted traceback (or, for a JobError, just its message)."""
    is_unsupported: bool = False
    """The exception is a `sp_harness.config.case.Unsupported`: the case declared the config out
    of scope from inside the rank (decided with isinstance on the rank, where the object lives)."""
    message: str = ""
    """The exception's own message, its first line (a long message's last line is not its cause)."""
    at: float = 0.0
    """Wall-clock time the rank caught it: which rank failed first, and which only after it."""
    exit_code: int | None = None
    """For a SystemExit: the code the job asked to exit with (the job exited, it did not raise)."""
    module: str = ""
    """The innermost module of the sharded model running when it raised, with its phase; '' where
    none was tracked (`failure.mark_module`)."""
    phase: str = ""
    """The job's phase when it raised (`PhaseEntered.phase`); '' for a job that marks none."""


@dataclass(kw_only=True, frozen=True)
class Shutdown:
    """Driver -> rank: leave the process group and exit."""



@dataclass(kw_only=True, frozen=True)
class Collective:
    """One collective as a rank was about to issue it (announced by sp_harness.capture.comm)."""

    index: int
    """Its position among the rank's announced collectives in the job, from 0."""
    group_index: int
    """Its position among the rank's announced collectives on the same group in the job, from 0:
    what the driver compares across the group's ranks (c10d pairs collectives up per group)."""
    kind: str
    """'all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'send', ..."""
    nbytes: int
    """Payload bytes of the full tensor (sp_harness.capture.comm's convention)."""
    group: tuple[int, ...]
    """Global ranks of its process group; () where the group could not be resolved."""
    module: str = ""
    """The innermost module of the sharded model running when it was issued, with its phase
    ('blocks.0.attn (backward)'); '' where none was (the grad sync) or none was tracked."""

    def describe(self) -> str:
        where = "ranks " + ",".join(map(str, self.group)) if self.group else "an unknown group"
        inside = f", in {self.module}" if self.module else ""
        return (f"{self.kind} of {self.nbytes} bytes on {where} (collective #{self.index} of the job, "
                f"#{self.group_index} on that group){inside}")


@dataclass(kw_only=True, frozen=True)
class CollectiveIssued:
    """Rank -> driver, during a job: the rank is about to issue `collective`. Sent before the
    collective so the driver knows where a rank that then blocks is."""

    job_id: int
    collective: Collective


@dataclass(kw_only=True, frozen=True)
class Progress:
    """Rank -> driver, during a job: how far the job is, for a person watching (nothing decides
    on it)."""

    job_id: int
    what: str
    """What is counted, e.g. 'step'."""
    done: int
    total: int


STEPS = "steps"
"""The phase in which the code under test runs its steps: a failure there is the code's (FAIL); a
failure in any phase a job marked before it is a setup that could not run (ERROR)."""


@dataclass(kw_only=True, frozen=True)
class PhaseEntered:
    """Rank -> driver, during a job: the job entered `phase`, so that a rank that then dies or
    hangs is known to have done so while setting up or while stepping."""

    job_id: int
    phase: str
    """'building the reference', 'shard()', ..., or `STEPS`."""


def job_ref(fn: Callable[..., object]) -> str:
    """The name ("module:function") a rank process imports `fn` by. Ranks are other processes,
    so a job (or a companion's service) must be a module-level function of a module they can
    import: a lambda, a nested function, a method or a function of `__main__` is an error here,
    in the driver, not an ImportError on every rank."""
    if not (inspect.isfunction(fn) or inspect.isbuiltin(fn)):
        raise TypeError(f"a rank job must be a module-level function, got {fn!r}")
    module, name = fn.__module__, fn.__qualname__
    if module in (None, "__main__") or "." in name or "<" in name:
        raise ValueError(f"a rank job must be a module-level function of an importable module (ranks are "
                         f"separate processes that import it by name), got {module}.{name}")
    if getattr(sys.modules.get(module), name, None) is not fn:
        raise ValueError(f"a rank job must be importable by its name: {module}.{name} is not {fn!r} "
                         f"(a decorator without functools.wraps, or a rebound name)")
    return f"{module}:{name}"


def resolve(fn_ref: str) -> Callable[..., Any]:
    """The function a job names (`job_ref`'s inverse), imported in the process that runs it."""
    module, _, name = fn_ref.partition(":")
    return getattr(importlib.import_module(module), name)
