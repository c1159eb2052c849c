"""Stage: launch. Which runner a command uses: the process's warm pools, or the torchrun
world it was started in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sp_harness.launch.pool import PoolManager
from sp_harness.launch.torchrun import TorchrunWorld, under_torchrun

_DEFAULT_MANAGER: PoolManager | None = None


def default_manager() -> PoolManager:
    """This process's pools (one per world size), started on first use."""
    global _DEFAULT_MANAGER
    if _DEFAULT_MANAGER is None:
        _DEFAULT_MANAGER = PoolManager()
    return _DEFAULT_MANAGER


def runner():
    """The torchrun world under torchrun, else this process's pools."""
    return TorchrunWorld() if under_torchrun() else default_manager()


class WithProgress:
    """A runner whose jobs report progress lines to `progress` (the CLI's stderr)."""

    def __init__(self, inner, progress: Callable[[str], None]):
        self.inner = inner
        self.progress = progress

    def run(self, world_size: int, fn_ref: str, payload: Any, *, timeout_s: float, label: str,
            case: str | None = None) -> list[Any]:
        return self.inner.run(world_size, fn_ref, payload, timeout_s=timeout_s, label=label, progress=self.progress,
                              case=case)

    def close(self) -> None:
        self.inner.close()


def is_leader() -> bool:
    """Whether this process reports: always outside torchrun, rank 0 under it."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def max_world_size() -> int:
    """The most ranks this machine runs: one per GPU under nccl; on CPU 4 per core (at least 8),
    or SP_HARNESS_MAX_WORLD_SIZE where set."""
    import os

    import torch

    text = os.environ.get("SP_HARNESS_MAX_WORLD_SIZE", "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"SP_HARNESS_MAX_WORLD_SIZE must be a whole number >= 1, got {text!r}")
        return int(text)
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(8, 4 * (os.cpu_count() or 1))


def check_world_size(world_size: int) -> None:
    """A usage error, before any rank starts, for more ranks than this machine runs."""
    limit = max_world_size()
    if world_size > limit:
        raise ValueError(f"world_size {world_size} is more ranks than this machine runs (at most {limit}; "
                         f"set SP_HARNESS_MAX_WORLD_SIZE to change the limit)")
