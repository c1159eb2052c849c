"""Stage: step. DeepSpeed's process-wide state on a rank, which its Ulysses cases (`deepspeed_ulysses`,
`deepspeed_hf`) and its engine step (`deepspeed_step`) share: the per-process setup, the launcher
environment its engine asserts, its comm backend over the harness's world and its
sequence-parallel groups. None of it changes what DeepSpeed computes.

- Per-process imports (`Case.preload`, `DEEPSPEED_PRELOAD`): DeepSpeed's import and its one CPU
  shim (`cpu_shims`): its comm backend builds no `deepspeed_shm_comm` op, as on CUDA.
- Launcher environment (`launcher_env`): DeepSpeed's engine asserts `LOCAL_RANK` is set (its
  launcher, torchrun or init_distributed's MPI discovery set it); the harness starts its ranks
  itself, so it is set to the rank's device index (CPU: the rank; one host). No CPU shim is
  needed: DeepSpeed's accelerator detection picks its CPU accelerator and the gloo backend.
"""

from __future__ import annotations

import importlib
import os

import torch.distributed as dist

from sp_harness import RankContext

DEEPSPEED_VERSION = "0.19.8"
"""The release the DeepSpeed cases are tested with (the `deepspeed` extra pins it)."""


def launcher_env(ctx: RankContext) -> None:
    """What DeepSpeed's launcher would have set and its engine asserts: LOCAL_RANK (this rank's
    device index on its host; on CPU the rank: the harness runs one host)."""
    local = ctx.device.index if ctx.device.type != "cpu" and ctx.device.index is not None else ctx.rank
    os.environ.setdefault("LOCAL_RANK", str(local))


def init_distributed() -> None:
    """DeepSpeed's communication backend over the harness's already-initialized gloo world
    (it wraps torch.distributed: `TorchBackend`)."""
    import deepspeed

    cpu_shims()
    deepspeed.init_distributed(dist_backend=dist.get_backend())


def sp_groups(ctx: RankContext):
    """DeepSpeed's own sequence-parallel groups (`parallel_state_sp.initialize_sequence_parallel`,
    made once per mesh in a rank process; 0.16.x: `compat.SLIM_MPU`), checked to be the harness's
    SP group; None at SP 1 (DeepSpeed refuses a sequence_parallel_size of 1: the engine is then
    plain DP)."""
    from sp_harness.cases.frameworks.deepspeed import compat

    if ctx.tp == 1:
        return None
    ps = compat.sp_groups_module()
    made = ps._SEQUENCE_PARALLEL_GROUP
    if made is None or tuple(dist.get_process_group_ranks(made)) != ctx.tp_ranks or \
            ps.get_sequence_data_parallel_world_size() != ctx.world_size:
        compat.release_sp_groups(ps)
        ps.initialize_sequence_parallel(ctx.tp)
    theirs = tuple(dist.get_process_group_ranks(ps.get_sequence_parallel_group()))
    if theirs != ctx.tp_ranks:
        raise RuntimeError(f"DeepSpeed's SP group {theirs} is not the harness's {ctx.tp_ranks}")
    return ps


def _no_shm_op() -> None:
    """`build_shm_op` as it is on CUDA: no op (see `cpu_shims`)."""
    return None


def cpu_shims() -> None:
    """The CPU shim, idempotent, a no-op where CUDA is available. DeepSpeed's comm backend
    (`TorchBackend.__init__`) JIT-builds its CPU `deepspeed_shm_comm` op with g++ on the CPU
    accelerator: 1-6 minutes on a 2-core machine, on every fresh machine (CI's every run). That
    op serves one call, `inference_all_reduce`, which only AutoTP's inference layers
    (`module_inject`) make; Ulysses training, its engine and HF's Ulysses path never do. On CUDA
    the accelerator has no such builder and `build_shm_op` returns None; here it does the same,
    so DeepSpeed's comm backend is the one it has on CUDA and every collective it makes is the
    same torch.distributed call: what DeepSpeed computes is unchanged."""
    import torch

    if torch.cuda.is_available():
        return
    # not `import deepspeed.comm.torch as ...`: that binds `deepspeed.comm.torch`, the attribute,
    # which is torch itself (deepspeed.comm imports it), not DeepSpeed's backend module
    backend = importlib.import_module("deepspeed.comm.torch")
    setattr(backend, "build_shm_op", _no_shm_op)  # noqa: B010 (a module attribute mypy cannot see)


DEEPSPEED_PRELOAD = ("deepspeed.sequence.layer", f"{__name__}:cpu_shims")
"""A DeepSpeed case's `Case.preload`: DeepSpeed's import and its CPU shim (before its comm backend
is made), outside any job's clock; once by the fork server on CPU."""


__all__ = ["DEEPSPEED_PRELOAD", "DEEPSPEED_VERSION", "cpu_shims", "init_distributed", "launcher_env", "sp_groups"]
