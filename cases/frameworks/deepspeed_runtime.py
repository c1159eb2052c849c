"""Stage: step. DeepSpeed's process-wide state on a rank, which its Ulysses cases (`deepspeed_ulysses`,
`deepspeed_hf`) and its engine step (`deepspeed_step`) share: the per-process setup, the launcher
environment its engine asserts, its comm backend over the harness's world and its
sequence-parallel groups. None of it changes what DeepSpeed computes.

- Per-process setup (`Case.setup`): DeepSpeed's import and the JIT build of its CPU
  `deepspeed_shm_comm` op, which `deepspeed.init_distributed` loads (minutes on a loaded 2-core
  machine the first time; cached in ~/.cache/torch_extensions afterwards). A build killed mid-way
  leaves torch's build lock behind; the next setup removes it, with a warning
  (`build_extension_exclusively`).
- Launcher environment (`launcher_env`): DeepSpeed's engine asserts `LOCAL_RANK` is set (its
  launcher, torchrun or init_distributed's MPI discovery set it); the harness starts its ranks
  itself, so it is set to the rank's device index (CPU: the rank; one host). No CPU shim is
  needed: DeepSpeed's accelerator detection picks its CPU accelerator and the gloo backend.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from sp_harness import RankContext
from sp_harness.cases.frameworks.common import build_extension_exclusively

DEEPSPEED_VERSION = "0.19.8"
"""The release the DeepSpeed cases are tested with (the `deepspeed` extra pins it)."""

SHM_OP_NAME = "deepspeed_shm_comm"
"""The torch extension `build_shm_op` JIT-builds (DeepSpeed's `ShareMemCommBuilder.NAME`: its
build dir and torch's build lock are named after it)."""


def launcher_env(ctx: RankContext) -> None:
    """What DeepSpeed's launcher would have set and its engine asserts: LOCAL_RANK (this rank's
    device index on its host; on CPU the rank: the harness runs one host)."""
    local = ctx.device.index if ctx.device.type != "cpu" and ctx.device.index is not None else ctx.rank
    os.environ.setdefault("LOCAL_RANK", str(local))


def init_distributed() -> None:
    """DeepSpeed's communication backend over the harness's already-initialized gloo world
    (it wraps torch.distributed: `TorchBackend`, which loads its shm op)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())


def sp_groups(ctx: RankContext):
    """DeepSpeed's own sequence-parallel groups (`parallel_state_sp.initialize_sequence_parallel`,
    made once per mesh in a rank process), checked to be the harness's SP group; None at SP 1
    (DeepSpeed refuses a sequence_parallel_size of 1: the engine is then plain DP)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as ps

    if ctx.tp == 1:
        return None
    made = ps._SEQUENCE_PARALLEL_GROUP
    if made is None or tuple(dist.get_process_group_ranks(made)) != ctx.tp_ranks or \
            ps.get_sequence_data_parallel_world_size() != ctx.world_size:
        ps._release_sequence_parallel_groups()
        ps.initialize_sequence_parallel(ctx.tp)
    theirs = tuple(dist.get_process_group_ranks(ps.get_sequence_parallel_group()))
    if theirs != ctx.tp_ranks:
        raise RuntimeError(f"DeepSpeed's SP group {theirs} is not the harness's {ctx.tp_ranks}")
    return ps


def deepspeed_setup() -> None:
    """Per process, outside any job's clock: DeepSpeed's import and its CPU comm op's JIT build
    (what `deepspeed.init_distributed` loads), under `build_extension_exclusively` so that a
    build killed mid-way (its torch `lock` left behind) does not hang every later setup."""
    import deepspeed  # noqa: F401
    import deepspeed.sequence.layer  # noqa: F401
    from deepspeed.comm.torch import build_shm_op

    build_extension_exclusively(SHM_OP_NAME, build_shm_op)


__all__ = ["DEEPSPEED_VERSION", "SHM_OP_NAME", "deepspeed_setup", "init_distributed", "launcher_env", "sp_groups"]
