"""Stage: launch. Under `torchrun`: there is no driver: every rank runs every job in-process
on the env:// world (SPMD) and the outcomes are gathered on every rank, behind the same `run`
interface as `PoolManager`.

With no driver to watch them, each rank watches itself: a job (the gather of its outcomes
included) that runs past its timeout makes the rank print the case, config and its own Python
stack and exit 124, which torchrun sees as a failed worker and ends the others (they die on its
SIGTERM even while blocked in a collective: under torchrun no Python handler delays it). At the
end, `finish` exits without running C++ static destructors, where gloo's threads could abort
("terminate called without an active exception") after the verdict was printed."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sp_harness.launch.case_setup import SETUP_TIMEOUT_S
from sp_harness.launch.failure import RankFailure, SetupError, raised
from sp_harness.launch.wire import Job, JobDone, JobRaised, job_ref
from sp_harness.launch.worker import run_job, run_setup

P = TypeVar("P")
R = TypeVar("R")


class TorchrunWorld:
    """The torchrun (env://) world as a pool: every rank runs every job in-process (SPMD)."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = torchrun_backend()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self._job_id = 0

    def run(self, world_size: int, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            progress: Callable[[str], None] | None = None, case: str | None = None) -> list[R]:
        """`progress` is accepted and unused: there is no driver to report to. Nor is a desync
        detected: each rank runs in-process and a mismatch ends as the backend's own error or
        timeout, as it would in production."""
        fn_ref = job_ref(fn)
        if world_size != self.world_size:
            raise ValueError(f"torchrun world has {self.world_size} ranks, the job asks for {world_size}")
        if case is not None:
            # one world, one process per rank: no isolation to give; the case's setup runs once

            self._job_id += 1
            with Watchdog(SETUP_TIMEOUT_S, label + " (setup)", self.rank):
                setup = run_job(Job(job_id=self._job_id, fn_ref=job_ref(run_setup), payload=case))
                try:
                    self._gather(setup, label + " (setup)")
                except RankFailure as exc:
                    raise SetupError.of(case, exc) from exc
        self._job_id += 1
        with Watchdog(timeout_s, label, self.rank):
            reply = run_job(Job(job_id=self._job_id, fn_ref=fn_ref, payload=payload))
            return self._gather(reply, label)

    def _gather(self, reply: JobDone | JobRaised, label: str) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, reply)
        errors = [raised(r, g) for r, g in enumerate(gathered) if isinstance(g, JobRaised)]
        if errors:
            raise RankFailure(label, errors)
        return [g.result for g in gathered]

    def close(self) -> None:
        pass


TIMEOUT_EXIT_CODE = 124
"""What a rank exits with when its watchdog fires (timeout(1)'s code)."""


class Watchdog:
    """A timer around one job on this rank: past `timeout_s`, the rank prints what hung (the
    job's label: case and config) and its own stack to stderr and exits TIMEOUT_EXIT_CODE."""

    def __init__(self, timeout_s: float, label: str, rank: int):
        self.timeout_s, self.label, self.rank = timeout_s, label, rank
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        sys.stderr.write(f"sp-harness: {self.label}: rank {self.rank} timed out after {self.timeout_s:g}s "
                         f"(under torchrun; its Python stack follows)\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(TIMEOUT_EXIT_CODE)

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def finish(code: int) -> None:
    """Ends a torchrun rank with `code`: output flushed, the process group destroyed, then an
    exit that skips C++ static destructors (see the module docstring)."""
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def torchrun_backend() -> str:
    """The backend a torchrun world joins: nccl where CUDA is available, else gloo."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                     and "MASTER_ADDR" in os.environ)
