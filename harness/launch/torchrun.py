"""Stage: launch ranks, under `torchrun`. There is no driver: every rank runs every job in-process
on the env:// world (SPMD) and the outcomes are gathered on every rank, behind the same `run`
interface as `PoolManager`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from sp_harness.launch.failure import RankFailure, SetupError, raised
from sp_harness.launch.wire import Job, JobRaised
from sp_harness.launch.worker import run_job


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
        self._job_id = 0

    def run(self, world_size: int, fn_ref: str, payload: Any, *, timeout_s: float, label: str,
            progress: Callable[[str], None] | None = None, case: str | None = None) -> list[Any]:
        """`progress` is accepted and unused: there is no driver to report to. Nor is a desync
        detected: each rank runs in-process and a mismatch ends as the backend's own error or
        timeout, as it would in production."""
        if world_size != self.world_size:
            raise ValueError(f"torchrun world has {self.world_size} ranks, the job asks for {world_size}")
        if case is not None:
            # one world, one process per rank: no isolation to give; the case's setup runs once
            self._job_id += 1
            setup = run_job(Job(job_id=self._job_id, fn_ref="sp_harness.launch.worker:run_setup", payload=case))
            try:
                self._gather(setup, label + " (setup)")
            except RankFailure as exc:
                raise SetupError.of(case, exc) from exc
        self._job_id += 1
        reply = run_job(Job(job_id=self._job_id, fn_ref=fn_ref, payload=payload))
        return self._gather(reply, label)

    def _gather(self, reply, label: str) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, reply)
        errors = [raised(r, g) for r, g in enumerate(gathered) if isinstance(g, JobRaised)]
        if errors:
            raise RankFailure(label, errors)
        return [g.result for g in gathered]

    def close(self) -> None:
        pass


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                     and "MASTER_ADDR" in os.environ)
