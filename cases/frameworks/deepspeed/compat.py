"""Stage: step. DeepSpeed's releases: the range this integration supports and what differs
inside it, asked as capabilities (sp_harness.cases.frameworks.releases).

Everything else in the package asks this module, never a version string. Importing it imports no
framework code; `missing()` and `lacking()` do (the driver asks both in a child interpreter:
`require` from each case's `validate`, `lacks` for the optional APIs a config may need).

What differs across 0.16.0 to 0.19.8 in what the integration calls (read in each release's
source; measured where the docs say so, docs/frameworks/deepspeed.md "Releases"):

- DeepSpeed's own SP groups, `deepspeed.runtime.sequence_parallel.parallel_state_sp` (the
  engine's `mpu`): 0.17.0 on. Before it DeepSpeed had no SP-groups module of its own; a user
  handed the engine Megatron-DeepSpeed's `mpu`, which DeepSpeed's `groups` then asked for its
  data-parallel group too (0.17.0 taught `groups` the slim mpu). 0.16.x: `SlimMpu` below.
- Releasing those groups between two jobs of a warm rank process
  (`parallel_state_sp._release_sequence_parallel_groups`): 0.19.8 on. Before it, by hand
  (`release_sp_groups`: the two module globals set to None, which is that function's whole body).
- `DistributedAttention(num_kv_heads=)` (the k/v head count carried per instance, #8316): 0.19.7
  on. Before it each all-to-all split its own tensor's heads, and an uneven count went through a
  process-wide slot (`deepspeed.module_inject.tp_shard.num_kv_heads`, set by the first uneven
  tensor and never cleared: #8291). Without the keyword the split is right exactly where every
  tensor's own split is (`gqa_without_num_kv_heads`); elsewhere UNSUPPORTED naming the API, and
  the slot is cleared before each job (`reset_process_wide_kv_heads`), as a new process has it.
- `UlyssesSPAttentionHF.register_with_transformers`: 0.17.0 on; its sequence length is
  `max_length` before 0.18.x's `seq_length` (the same value, renamed), and it takes a model (not
  only a name or path) from 0.18.1 (`register_ulysses_hf`).
- `parallel_state_sp.get_model_parallel_rank / _group / _world_size` (#7649): 0.18.2 on. Before it
  the engine's own stage-0 clipping (`clip_fp32_gradients` -> `clip_grad_norm_(mpu=...)`) raises
  AttributeError on the slim mpu: a shipped bug, `release-ds-7649-stage0-clip-slim-mpu`.
  Its sequence <-> heads exchange is the module function `ulysses_sp._dim_zero_all_to_all` from
  0.19.7 (#8491; before it `_DimZeroAllToAll.apply` from `deepspeed.sequence.layer`).
- ZeRO-1/2 under torch's own `loss.backward()` (what the side-by-side cases call; the engine-step
  cases call `engine.backward`): 0.17.2 on (its `IPGBucket`s). Before it ZeRO made its reduce
  buffers in its own `backward` and a plain backward raised `no attribute 'ipg_index'` in its
  grad hook: those configs are UNSUPPORTED there, naming it (`ZERO_TORCH_BACKWARD`).
- `DistributedAttention.forward(..., rotary_pos_emb=None)`: 0.16.2 on; it is never passed (None is
  its default).
- ZeRO-1/2's CPU-offload accumulation (`DeepSpeedZeroOptimizer.copy_grads_in_partition`,
  `async_accumulate_grad_in_cpu_via_gpu`): the text the step mutants revert has two fixed forms
  (`is_gradient_accumulation_boundary` a property in 0.19.0 to 0.19.4, a method later) and, on
  the releases that shipped #7967 / #7981, the buggy form itself (`step.REGRESSIONS`).
- `engine.allreduce_gradients()` on an engine without an optimizer: 0.19.x on (before it the
  boundary flag is set on `engine.optimizer` unguarded: AttributeError on None). The side-by-side
  cases hand every engine a never-stepped SGD(lr=0) (`case.grad_sync_of`), which stage 0 holds
  unwrapped: the reduction, `buffered_allreduce_fallback`, is the same.
- Where a param's accumulated grad lives under `BF16_Optimizer` (stage 0 in bfloat16 before
  0.17.6, ZeRO-1 with fp32 grad accumulation): in its fp32 buffer, `param._hp_grad`, while
  `param.grad` keeps the last micro-batch's bf16 staging grad (cleared before each backward).
  `safe_get_full_grad` reads that buffer first from 0.19.8 (read in the sdists of 0.16.0 to
  0.19.8); before it, it returns `param.grad` whenever it is set: the last micro-batch alone
  (0.16.0, stage 0 bf16 at K 3: every grad 0, the engine's last micro-batch being empty).
  `full_grad` reads what the optimizer applies, as the newer `safe_get_full_grad` does.
- Unchanged over the range (asked by `missing()`): `deepspeed.initialize(model=, optimizer=,
  config=, mpu=)`, `engine.backward / step / set_gradient_accumulation_boundary /
  get_global_grad_norm / allreduce_gradients`, `deepspeed.utils.safe_get_full_grad`,
  `runtime.utils.clip_grad_norm_`, the config keys `zero_force_ds_cpu_optimizer` and
  `zero_allow_untested_optimizer`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from sp_harness.cases.frameworks.releases import ReleaseRange

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="deepspeed", oldest="0.16.0", newest="0.19.8"),
)
"""Supported releases, both ends included: each end's framework tests and release cases pass
(docs/frameworks/README.md, the release matrix)."""

NUM_KV_HEADS = "deepspeed.sequence.layer.DistributedAttention(num_kv_heads=)"
ULYSSES_HF = "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF"
MODULE_EXCHANGE = "deepspeed.runtime.sequence_parallel.ulysses_sp._dim_zero_all_to_all"
DIM_ZERO_EXCHANGE = "deepspeed.sequence.layer._dim_zero_all_to_all"
ZERO_TORCH_BACKWARD = ("ZeRO-1/2 reducing under torch's own loss.backward() (deepspeed.runtime.zero.stage_1_and_2."
                       "IPGBucket: before it DeepSpeedZeroOptimizer made its reduce buffers in its own backward, "
                       "which only engine.backward runs)")
OPTIONAL = (NUM_KV_HEADS, ULYSSES_HF, MODULE_EXCHANGE, DIM_ZERO_EXCHANGE, ZERO_TORCH_BACKWARD)
"""APIs only some configs need (`lacks`): a release without one runs every other case."""

_ENGINE_METHODS = ("backward", "step", "set_gradient_accumulation_boundary", "get_global_grad_norm",
                   "allreduce_gradients", "gradient_accumulation_steps")
_CONFIG_KEYS = ("zero_force_ds_cpu_optimizer", "zero_allow_untested_optimizer")


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def missing() -> tuple[str, ...]:
    """Each API this integration needs that the installed release lacks, named as a user would
    look it up."""
    import deepspeed

    gone = []
    if "mpu" not in inspect.signature(deepspeed.initialize).parameters:
        gone.append("deepspeed.initialize(mpu=)")
    for module, name in (("deepspeed", "init_distributed"), ("deepspeed.sequence.layer", "DistributedAttention"),
                         ("deepspeed.utils", "safe_get_full_grad"), ("deepspeed.runtime.utils", "clip_grad_norm_"),
                         ("deepspeed.runtime.engine", "DeepSpeedEngine"),
                         ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")):
        if not _has(module, name):
            gone.append(f"{module}.{name}")
    if "deepspeed.runtime.engine.DeepSpeedEngine" not in gone:
        from deepspeed.runtime.engine import DeepSpeedEngine

        gone += [f"DeepSpeedEngine.{m}" for m in _ENGINE_METHODS if not hasattr(DeepSpeedEngine, m)]
    if "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer" not in gone:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        gone += [f"DeepSpeedZeroOptimizer.{m}" for m in ("copy_grads_in_partition",
                                                         "async_accumulate_grad_in_cpu_via_gpu")
                 if not hasattr(DeepSpeedZeroOptimizer, m)]
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    source = inspect.getsource(importlib.import_module("deepspeed.runtime.config"))
    gone += [f"the DeepSpeed config key {key!r}" for key in _CONFIG_KEYS if key not in source]
    del DeepSpeedZeroConfig  # its import is the check that ZeRO's config module is there
    return tuple(gone)


def lacking() -> tuple[str, ...]:
    """Each of `OPTIONAL` the installed release lacks (imports DeepSpeed; the driver asks `lacks`)."""
    from deepspeed.sequence.layer import DistributedAttention

    gone = []
    if "num_kv_heads" not in inspect.signature(DistributedAttention.__init__).parameters:
        gone.append(NUM_KV_HEADS)
    if not _has("deepspeed.runtime.sequence_parallel.ulysses_sp", "UlyssesSPAttentionHF"):
        gone.append(ULYSSES_HF)
    if not _has("deepspeed.runtime.sequence_parallel.ulysses_sp", "_dim_zero_all_to_all"):
        gone.append(MODULE_EXCHANGE)
    if not _has("deepspeed.sequence.layer", "_dim_zero_all_to_all"):
        gone.append(DIM_ZERO_EXCHANGE)
    if not _has("deepspeed.runtime.zero.stage_1_and_2", "IPGBucket"):
        gone.append(ZERO_TORCH_BACKWARD)
    return tuple(gone)


def lacks(api: str) -> bool:
    """Whether the installed release lacks optional API `api` (one of `OPTIONAL`), asked in a
    child interpreter once per process (releases.probe of `optional`, whose `missing` is `lacking`)."""
    from sp_harness.cases.frameworks.releases import probe

    if api not in OPTIONAL:
        raise ValueError(f"{api!r} is not an optional DeepSpeed API this integration asks for: {', '.join(OPTIONAL)}")
    found = probe("sp_harness.cases.frameworks.deepspeed.optional")
    if any(item.startswith("an import of the framework") for item in found):
        return True  # require() has already said why, where the import fails
    return api in found


def unsupported_without(api: str, what: str) -> str:
    """The reason a config is UNSUPPORTED on a release lacking `api`."""
    from sp_harness.cases.frameworks.releases import installed_release

    return (f"{what} needs {api}, which deepspeed {installed_release('deepspeed')} lacks "
            f"(supported: {', '.join(r.describe() for r in RELEASES)})")


# --- in a rank (DeepSpeed imported) ---


def sp_groups_module() -> Any:
    """The engine's SP-groups `mpu`: DeepSpeed's `parallel_state_sp` where the release has it,
    else `SLIM_MPU` (0.16.x)."""
    try:
        return importlib.import_module("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    except ImportError:
        return SLIM_MPU


def release_sp_groups(ps: Any) -> None:
    """Forget the SP groups `ps` holds, so that `initialize_sequence_parallel` makes new ones
    (a warm rank process's next job on another mesh). DeepSpeed's own
    `_release_sequence_parallel_groups` where the release has it; before 0.19.8 the same by hand:
    that function's whole body is setting the two module globals to None, so nothing DeepSpeed
    computes differs (the groups made next are made by DeepSpeed's `initialize_sequence_parallel`)."""
    own = getattr(ps, "_release_sequence_parallel_groups", None)
    if own is not None:
        own()
        return
    ps._SEQUENCE_PARALLEL_GROUP = None
    ps._SEQUENCE_DATA_PARALLEL_GROUP = None


def reset_process_wide_kv_heads() -> None:
    """Before 0.19.7 DistributedAttention's uneven-heads path read and set a process-wide k/v head
    count (`deepspeed.module_inject.tp_shard.num_kv_heads`), set by the first model whose heads did
    not divide the SP degree and never cleared (#8291). A warm rank process's next job starts with
    it unset, as a new process does; the first uneven all-to-all of that job sets it as in a new
    process. From 0.19.7 the count is per instance and `layer.py` no longer reads the slot."""
    layer = importlib.import_module("deepspeed.sequence.layer")
    if hasattr(layer, "get_num_kv_heads") and hasattr(layer, "set_num_kv_heads"):
        layer.set_num_kv_heads(None)


def gqa_without_num_kv_heads(num_heads: int, num_kv_heads: int, sp: int) -> bool:
    """Whether DistributedAttention without `num_kv_heads` (before 0.19.7) splits these heads as
    0.19.7's does: each all-to-all splits its own tensor's heads, so the query heads land on the
    rank of their k/v group exactly when both counts divide the SP degree (the even path: rank r
    gets query heads r*a/sp.. and k/v heads r*a_kv/sp.., and query head i's group i*a_kv/a is
    among them), or when there are as many k/v heads as query heads (plain multi-head attention,
    even or through the uneven-heads path, which splits every tensor by the same count)."""
    return num_heads == num_kv_heads or (num_heads % sp == 0 and num_kv_heads % sp == 0)


def distributed_attention(local: Any, group: Any, *, scatter_idx: int, gather_idx: int,
                          num_kv_heads: int | None) -> Any:
    """DeepSpeed's `DistributedAttention(local, group, scatter_idx, gather_idx[, num_kv_heads])`;
    `num_kv_heads` is passed only where it is given (a release without the keyword is refused in
    the case's validate: `lacks(NUM_KV_HEADS)`)."""
    from deepspeed.sequence.layer import DistributedAttention

    reset_process_wide_kv_heads()
    kwargs = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
    return DistributedAttention(local, group, scatter_idx=scatter_idx, gather_idx=gather_idx, **kwargs)


def register_ulysses_hf(model: Any, *, core: str, sp: int, batch: int, seq_len: int) -> Any:
    """`UlyssesSPAttentionHF.register_with_transformers` for `model` (an HF PreTrainedModel), with
    the run's sequence length under the name the release takes it (`seq_length`; `max_length`
    before it was renamed: the same value, the length every rank's query shape is asserted
    against). Before 0.18.1 it takes a model name or path only and reads nothing but
    `AutoConfig.from_pretrained(path)` from it (the heads, head size, k/v heads, layers): there the
    model's own config is saved to a temporary directory, handed over as that path and removed,
    so the attention is built from the same config values either way."""
    import tempfile

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    register = UlyssesSPAttentionHF.register_with_transformers
    params = inspect.signature(register).parameters
    length = {"seq_length": seq_len} if "seq_length" in params else {"max_length": seq_len}
    kwargs = dict(core_attn_implementation=core, sequence_parallel_size=sp, micro_batch_size=batch,
                  seq_length_is_variable=False, **length)
    if "PreTrainedModel" in inspect.getsource(register):  # it tells a model from a path
        return register(model_name_or_path=model, **kwargs)
    with tempfile.TemporaryDirectory(prefix="sp-harness-hf-config-") as path:
        model.config.save_pretrained(path)
        return register(model_name_or_path=path, **kwargs)


class _SlimMpu:
    """0.16.x: DeepSpeed's SP groups as 0.17.0's `parallel_state_sp` makes them, handed to the
    engine as its `mpu` (0.16 has no SP-groups module; its users handed the engine Megatron-
    DeepSpeed's mpu). The groups are DeepSpeed's own `deepspeed.comm.new_group` of the same ranks
    as 0.17's `initialize_sequence_parallel` (contiguous SP groups of `sp` ranks, one sequence-
    data-parallel group of the whole world); what 0.16's `deepspeed.utils.groups` also asks an mpu
    for (it learned the slim mpu only in 0.17.0) is what Megatron-DeepSpeed's mpu answers with
    SP alone (tensor and pipeline parallel size 1): the data-parallel group (the ranks of one SP
    rank) and model-parallel groups of one rank each, world size 1, rank 0. So ZeRO-1/2 count every
    rank's partition in their norm and skip the model-parallel all-reduce, as 0.17+ ZeRO does for
    the slim mpu (its `model_parallel_group = None` branch), and `clip_grad_norm_`'s all-reduce over
    the model-parallel group is a no-op before its mean over DP of equal norms. The engine reduces
    over the same sequence-data-parallel group with the same divisor, world / sp, as on 0.17+
    (`runtime.sp_groups` checks the SP group is the harness's), so nothing DeepSpeed computes differs."""

    _SEQUENCE_PARALLEL_GROUP: Any = None
    _SEQUENCE_DATA_PARALLEL_GROUP: Any = None
    _DATA_PARALLEL_GROUP: Any = None
    _MODEL_PARALLEL_GROUP: Any = None

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        from deepspeed import comm as dist

        world, rank, sp = dist.get_world_size(), dist.get_rank(), sequence_parallel_size
        if sp <= 1 or world % sp:
            raise ValueError(f"sequence_parallel_size must be > 1 and divide the world ({world}), got {sp}")
        assert self._SEQUENCE_PARALLEL_GROUP is None, "sequence parallel group is already initialized"
        for i in range(world // sp):  # every rank makes every group, in the same order
            ranks = list(range(i * sp, (i + 1) * sp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self._SEQUENCE_PARALLEL_GROUP = group
        for j in range(sp):
            ranks = list(range(j, world, sp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self._DATA_PARALLEL_GROUP = group
        for r in range(world):
            group = dist.new_group([r])
            if r == rank:
                self._MODEL_PARALLEL_GROUP = group
        self._SEQUENCE_DATA_PARALLEL_GROUP = dist.new_group(list(range(world)))

    def _release_sequence_parallel_groups(self) -> None:
        self._SEQUENCE_PARALLEL_GROUP = self._SEQUENCE_DATA_PARALLEL_GROUP = None
        self._DATA_PARALLEL_GROUP = self._MODEL_PARALLEL_GROUP = None

    def _size(self, group: Any) -> int:
        from deepspeed import comm as dist

        return dist.get_world_size(group=group)

    def _rank(self, group: Any) -> int:
        from deepspeed import comm as dist

        return dist.get_rank(group=group)

    def get_sequence_parallel_group(self) -> Any:
        assert self._SEQUENCE_PARALLEL_GROUP is not None, "sequence parallel group is not initialized"
        return self._SEQUENCE_PARALLEL_GROUP

    def get_sequence_data_parallel_group(self) -> Any:
        assert self._SEQUENCE_DATA_PARALLEL_GROUP is not None, "sequence data parallel group is not initialized"
        return self._SEQUENCE_DATA_PARALLEL_GROUP

    def get_data_parallel_group(self) -> Any:
        assert self._DATA_PARALLEL_GROUP is not None, "data parallel group is not initialized"
        return self._DATA_PARALLEL_GROUP

    def get_sequence_parallel_world_size(self) -> int:
        return self._size(self.get_sequence_parallel_group())

    def get_sequence_parallel_rank(self) -> int:
        return self._rank(self.get_sequence_parallel_group())

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size(self.get_sequence_data_parallel_group())

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank(self.get_sequence_data_parallel_group())

    def get_data_parallel_world_size(self) -> int:
        return self._size(self.get_data_parallel_group())

    def get_data_parallel_rank(self) -> int:
        return self._rank(self.get_data_parallel_group())

    def get_model_parallel_group(self) -> Any:
        assert self._MODEL_PARALLEL_GROUP is not None, "model parallel group is not initialized"
        return self._MODEL_PARALLEL_GROUP

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


SLIM_MPU = _SlimMpu()
"""The one SP-groups mpu of a 0.16.x rank process (as `parallel_state_sp` is one module)."""


def full_grad(param: Any) -> Any:
    """`param`'s whole grad as DeepSpeed's optimizer will apply it: `safe_get_full_grad`, but
    `BF16_Optimizer`'s fp32 accumulation first where it keeps one, which the releases before
    0.19.8 read after the bf16 staging grad (see above). That buffer, `param._hp_grad`, is the
    param's whole grad (a view of the flat fp32 grads every rank all-reduces), read as is:
    0.16.0's `get_full_hp_grad` raises on it ("The size of tensor a (32) must match the size of
    tensor b (2048)", measured)."""
    from deepspeed.utils import safe_get_full_grad

    hp = getattr(param, "_hp_grad", None)
    if hp is not None and hp.numel() == param.numel():
        return hp.view(param.shape)
    return safe_get_full_grad(param)


__all__ = ["DIM_ZERO_EXCHANGE", "MODULE_EXCHANGE", "NUM_KV_HEADS", "OPTIONAL", "RELEASES", "SLIM_MPU", "ULYSSES_HF",
           "ZERO_TORCH_BACKWARD",
           "distributed_attention", "full_grad", "gqa_without_num_kv_heads", "lacking", "lacks", "missing",
           "register_ulysses_hf", "release_sp_groups", "reset_process_wide_kv_heads", "sp_groups_module", "unsupported_without"]
