"""Stage: launch. The runner interface, and which runner a command uses: the process's warm
pools, or the torchrun world it was started in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from sp_harness.launch.manager import PoolManager
from sp_harness.launch.torchrun import TorchrunWorld, torchrun_backend, under_torchrun
from sp_harness.launch.wire import PoolOptions

P = TypeVar("P")
R = TypeVar("R")


class Runner(Protocol):
    """What runs a job on a world of ranks: `PoolManager` (this process's pools), `TorchrunWorld`
    (the torchrun world this process is a rank of), `WithProgress` around either."""

    def run(self, world_size: int, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            case: str | None = None) -> list[R]:
        """`fn(payload)` on every rank, the results indexed by rank. `fn` is a module-level
        function (ranks import it by name: sp_harness.launch.wire.job_ref); `case` is the case the
        job runs, whose setup runs first (None for jobs of no case); a rank's failure raises
        sp_harness.launch.failure.RankFailure naming `label`."""
        ...

    def close(self) -> None:
        """Ends the ranks this runner started (none under torchrun)."""
        ...


class ProgressRunner(Runner, Protocol):
    """A runner that also reports progress lines, as jobs start and as rank 0 reports."""

    def run(self, world_size: int, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            case: str | None = None, progress: Callable[[str], None] | None = None) -> list[R]: ...


_DEFAULT_MANAGER: PoolManager | None = None


def default_manager() -> PoolManager:
    """This process's pools (one per world size), started on first use."""
    global _DEFAULT_MANAGER
    if _DEFAULT_MANAGER is None:
        _DEFAULT_MANAGER = PoolManager()
    return _DEFAULT_MANAGER


def close_default_manager() -> None:
    """Closes this process's pools now, if it started any (the next use starts new ones)."""
    global _DEFAULT_MANAGER
    manager, _DEFAULT_MANAGER = _DEFAULT_MANAGER, None
    if manager is not None:
        manager.close()


def runner() -> ProgressRunner:
    """The torchrun world under torchrun, else this process's pools."""
    return TorchrunWorld() if under_torchrun() else default_manager()


class WithProgress:
    """A runner whose jobs report progress lines to `progress` (the CLI's stderr)."""

    def __init__(self, inner: ProgressRunner, progress: Callable[[str], None]):
        self.inner = inner
        self.progress = progress

    def run(self, world_size: int, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            case: str | None = None, progress: Callable[[str], None] | None = None) -> list[R]:
        """`progress`: where this job's lines go instead of the runner's own."""
        return self.inner.run(world_size, fn, payload, timeout_s=timeout_s, label=label,
                              progress=progress or self.progress, case=case)

    def close(self) -> None:
        self.inner.close()


def is_leader() -> bool:
    """Whether this process reports: always outside torchrun, rank 0 under it. Under torchrun
    the rank is read from the environment torchrun set, not from the process group: a command
    asks before its first job, which is what starts the group (a rank that asked the group
    then would answer True on every rank, and every rank would write and publish a report)."""
    import os

    import torch.distributed as dist

    if under_torchrun():
        return os.environ.get("RANK", "0") == "0"
    return not dist.is_initialized() or dist.get_rank() == 0


def runner_backend() -> str:
    """The backend the ranks of `runner()` join: torchrun's world nccl where CUDA is available
    (launch/torchrun.py); this process's pools their options' (gloo, CPU ranks, on a GPU machine
    too; the pytest plugin's pools choose for themselves, one GPU per rank)."""
    if under_torchrun():
        return torchrun_backend()
    return (_DEFAULT_MANAGER.options if _DEFAULT_MANAGER is not None else PoolOptions()).backend


def max_world_size(backend: str | None = None) -> int:
    """The most ranks this machine runs on `backend` (None: `runner_backend()`): one per GPU
    under nccl; on gloo 4 per core (at least 8), or SP_HARNESS_MAX_WORLD_SIZE where set. A GPU
    machine's gloo ranks are CPU processes: its GPU count does not limit them."""
    import os

    import torch

    text = os.environ.get("SP_HARNESS_MAX_WORLD_SIZE", "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"SP_HARNESS_MAX_WORLD_SIZE must be a whole number >= 1, got {text!r}")
        return int(text)
    if (backend or runner_backend()) == "nccl":
        return torch.cuda.device_count()
    return max(8, 4 * (os.cpu_count() or 1))


def check_world_size(world_size: int) -> None:
    """A usage error, before any rank starts, for more ranks than `runner()`'s ranks can be."""
    limit = max_world_size()
    if world_size > limit:
        raise ValueError(f"world_size {world_size} is more ranks than this machine runs (at most {limit}; "
                         f"set SP_HARNESS_MAX_WORLD_SIZE to change the limit)")
