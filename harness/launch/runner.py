"""Stage: launch ranks. Which runner a command uses: the process's warm pools, or the torchrun
world it was started in."""

from __future__ import annotations

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


def is_leader() -> bool:
    """Whether this process reports: always outside torchrun, rank 0 under it."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
