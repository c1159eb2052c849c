"""Stage: step. megatron-core's releases: the range this integration supports and what differs
inside it, asked as capabilities (sp_harness.cases.frameworks.releases).

Everything else in the package asks this module, never a version string. Importing it imports no
framework code; `missing()` does (the driver asks it in a child interpreter: `releases.require`
from each case's `validate`).

What differs across 0.15.0 to 0.19.2 in what the integration calls (read in each release's
source; the framework's tests and release cases run on 0.15.0, 0.15.3 and 0.16.1 under Python
3.11, and on 0.17.0, 0.18.2 and 0.19.2 under Python 3.12: docs/frameworks/megatron-core.md,
"Releases"):

- No weight-decay exemption: `get_megatron_optimizer(config_overrides={})` from 0.16.0; in 0.15.x
  `no_weight_decay_cond=` answering False for every param (`every_param_decayed`).
- A gated MLP's fused [gate; up] `linear_fc1`: laid out alike in every release (rank r: gate
  chunk r, then up chunk r), flagged `partition_stride` 2 from 0.16.0, left at 1 in 0.15.x, whose
  checkpoint factory alone states the layout (`gated_fc1_stride`).
- Learnable attention sinks: 0.15.x makes `softmax_offset` with `torch.empty` and never
  initialises it; 0.16 on, `config.init_method` (`initialise_sinks`, the reference's).
- The TP=1 reference in its own one-rank process: 0.15.x's `RowParallelLinear.forward` asserts
  megatron's global TP group is set up whatever groups it was built with; 0.16 on, not
  (`reference_parallel_state`).
- CP's batch split: `get_batch_on_this_cp_rank` takes the CP group by name in every release, but
  without it 0.15-0.16 read parallel_state's CP group and 0.17 on the whole world; 0.17 on also
  require `is_hybrid_cp` (`cp_batch_arguments`: the group, and False).
- The DDP grad sync: 0.17 on ask `torch.cuda.current_stream()` to wait for CUDA-graph events in
  `start_grad_sync` (a CPU shim: runtime.cpu_shims, item 7).
- A layer spec's q/k norms: 0.17 on refuse them where the config's `qk_layernorm` is off (a user's
  config error there, named by megatron; 0.16 built them anyway).
- Unchanged over the range (asked by `missing()`): explicit process groups end to end
  (`GPTModel(pg_collection=)`, `DistributedDataParallel(pg_collection=)`,
  `finalize_model_grads(model, num_tokens=, pg_collection=)`, `ProcessGroupCollection` with the
  same 20 groups), `TransformerConfig(softmax_type=)` (attention sinks), `initialize_rng_tracker(
  force_reset=)`, `initialize_model_parallel(order=, create_gloo_process_groups=)`, the local layer
  spec builder `get_gpt_layer_local_spec(num_experts=, normalization=, qk_layernorm=)`,
  `vocab_parallel_cross_entropy`, `get_forward_backward_func`, `OptimizerConfig(
  decoupled_weight_decay=)`, `OptimizerParamScheduler`, `shard_buffer`, `RankGenerator`, and what
  the CPU shims replace (`get_default_causal_mask` as `fused_softmax` binds it, `WrappedTorchNorm`).

Outside the range (`RELEASES`' note says it to a user):
- 0.14.x and older: the TP=1 reference is built beside the sharded twin in one rank process, so
  megatron must build and run it on the one-rank groups it is handed. 0.14 takes them under other
  names (`GPTModel(model_comm_pgs=)`, DDP's `grad_comm_pgs=`, `finalize_model_grads(
  grad_finalize_pgs=)`), but its `TransformerBlock` counts its layers from megatron's global
  pipeline group while it builds (measured on 0.14.0: "pipeline_model parallel group is not
  initialized" building the reference); 0.13 and older take no groups at all (their layers read
  megatron's global ones, the twin's, at every forward and backward). 0.14.0, the newest of them,
  is UNSUPPORTED naming the range.

0.17.0 and newer require Python >= 3.12 (cp312 wheels only), where the default suite's environment
is Python 3.11: a user gets them in a Python 3.12 environment (with pyenv, `PYENV_VERSION=3.12.1
python3.12 -m venv ENV`, then `ENV/bin/pip install torch==2.13.0 megatron-core==0.19.2` in one call:
PyPI's Linux torch for 3.12 is the CUDA build, which runs on the CPU as the CPU build does).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import torch

from sp_harness.cases.frameworks.releases import ReleaseRange

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="megatron-core", oldest="0.15.0", newest="0.19.2",
                 note="0.17+ need Python 3.12 (a python3.12 venv: docs/frameworks/megatron-core.md); "
                      "0.14 and older read megatron's global groups where the TP=1 reference needs its own"),
)
"""Supported releases, both ends included: each end's framework tests and release cases pass
(docs/frameworks/README.md, the release matrix)."""

_UNCHANGED = (
    ("megatron.core.models.gpt", "GPTModel"), ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
    ("megatron.core.distributed", "DistributedDataParallel"), ("megatron.core.distributed", "finalize_model_grads"),
    ("megatron.core.optimizer", "get_megatron_optimizer"), ("megatron.core.optimizer", "OptimizerConfig"),
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler"),
    ("megatron.core.pipeline_parallel", "get_forward_backward_func"),
    ("megatron.core.tensor_parallel", "vocab_parallel_cross_entropy"),
    ("megatron.core.tensor_parallel.random", "initialize_rng_tracker"),
    ("megatron.core.distributed.param_and_grad_buffer", "shard_buffer"),
    ("megatron.core.parallel_state", "RankGenerator"), ("megatron.core.parallel_state", "initialize_model_parallel"),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
    ("megatron.core.transformer.torch_norm", "WrappedTorchNorm"),
)
_KEYWORDS = (
    ("megatron.core.models.gpt", "GPTModel", "pg_collection"),
    ("megatron.core.distributed", "DistributedDataParallel", "pg_collection"),
    ("megatron.core.distributed", "finalize_model_grads", "num_tokens"),
    ("megatron.core.distributed", "finalize_model_grads", "pg_collection"),
    ("megatron.core.tensor_parallel.random", "initialize_rng_tracker", "force_reset"),
    ("megatron.core.parallel_state", "initialize_model_parallel", "order"),
    ("megatron.core.parallel_state", "initialize_model_parallel", "create_gloo_process_groups"),
    ("megatron.core.optimizer", "get_megatron_optimizer", "use_gloo_process_groups"),
)
_CONFIG_FIELDS = (
    ("megatron.core.transformer.transformer_config", "TransformerConfig", "softmax_type"),
    ("megatron.core.optimizer", "OptimizerConfig", "decoupled_weight_decay"),
)


def _get(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _takes(fn: Any, keyword: str) -> bool:
    return keyword in inspect.signature(fn).parameters


def missing() -> tuple[str, ...]:
    """Each API this integration needs that the installed release lacks, named as a user would
    look it up."""
    gone = [f"{module}.{name}" for module, name in _UNCHANGED if _get(module, name) is None]
    gone += [f"{module}.{name}({keyword}=)" for module, name, keyword in _KEYWORDS
             if _get(module, name) is not None and not _takes(_get(module, name), keyword)]
    gone += [f"{module}.{name}({field}=)" for module, name, field in _CONFIG_FIELDS
             if _get(module, name) is not None and field not in {f.name for f in dataclasses.fields(_get(module, name))}]
    if _get("megatron.core.process_groups_config", "ProcessGroupCollection") is None:
        gone.append("megatron.core.process_groups_config.ProcessGroupCollection")
    optimizer = _get("megatron.core.optimizer", "get_megatron_optimizer")
    if optimizer is not None and not (_takes(optimizer, "config_overrides") or _takes(optimizer, "no_weight_decay_cond")):
        gone.append("megatron.core.optimizer.get_megatron_optimizer(config_overrides=) (or no_weight_decay_cond=)")
    return tuple(gone)


# --- in a rank (megatron imported) ---


def reference_parallel_state() -> None:
    """Where the TP=1 reference runs in a one-rank world of its own (the rank's reference process)
    with megatron's parallel_state not set up, megatron's own `initialize_model_parallel(1)` there,
    as every TP=1 megatron run has it. Only where the release needs it: 0.15.x's
    `RowParallelLinear.forward` asks for the global TP group even with explicit groups
    (`tp_group=None` to `linear_with_grad_accumulation_and_async_allreduce`, which at TP 1 without
    SP uses no group but asserts one is initialized); from 0.16.0
    `get_tensor_model_parallel_group_if_none` passes None through where parallel_state is not set
    up. Asked by calling it (capability, not version). In a TP > 1 rank nothing: the sharded
    twin's parallel_state is set up before the reference runs there."""
    import warnings

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    if not dist.is_initialized() or dist.get_world_size() != 1 or ps.model_parallel_is_initialized():
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "tp_group is None, using default tp group"
            get_tensor_model_parallel_group_if_none(None)
        return
    except AssertionError:  # "tensor model parallel group is not initialized"
        ps.destroy_global_memory_buffer()  # an earlier reference's; megatron makes its own
        ps.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)


def gated_fc1_stride(model: Any) -> None:
    """A gated MLP's fused [gate; up] `linear_fc1` says its TP layout on its params, where the
    release does not. Every release lays it out alike: TP rank r holds gate chunk r then up chunk r
    (its `chunk(2)` is this rank's gate and up). 0.16 on, the params say so (`partition_stride` 2:
    "each TP rank stores interleaved [gate, up] portions", unless `use_kitchen`); 0.15.x leaves them
    at stride 1 and states the layout only in its checkpoint code (`MLP.sharded_state_dict`'s
    `apply_swiglu_sharded_factory`). Here each megatron `MLP` with `gated_linear_unit` and not
    `use_kitchen` whose fc1 is flagged tensor-parallel at stride 1 gets stride 2, 0.16's rule on the
    same config fields (a no-op on 0.16). Nothing megatron computes changes: in 0.15 only
    megatron-FSDP (not run here) reads `partition_stride`, and the weights this rank holds are
    loaded from the reference by the mapping the stride now states (`load_shard`)."""
    from megatron.core.transformer.mlp import MLP

    for module in model.modules():
        if not isinstance(module, MLP) or not module.config.gated_linear_unit or module.config.use_kitchen:
            continue
        for p in module.linear_fc1.parameters(recurse=False):
            if getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_stride", 1) == 1:
                p.partition_stride = 2


def initialise_sinks(model: Any) -> None:
    """A learnable attention sink (`softmax_offset`) of the TP=1 reference starts from values of its
    seeded init, where the release leaves it uninitialised. 0.15.x makes it with `torch.empty` and
    never initialises it (whatever memory held: a reference that differs run to run, NaN
    possible); 0.16 on, `DotProductAttention` applies `config.init_method` to it under
    `perform_initialization`. Where the release's `DotProductAttention.__init__` does not (read in
    its source), each sink is initialised as 0.16 does, from the reference's seeded generator; the
    sharded twin loads it from the reference, as every param. Asked of the reference alone."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if "init_method(self.softmax_offset)" in inspect.getsource(DotProductAttention.__init__):
        return
    with torch.no_grad():
        for module in model.modules():
            sinks = getattr(module, "softmax_offset", None)
            if isinstance(module, DotProductAttention) and isinstance(sinks, torch.nn.Parameter) and \
                    module.config.perform_initialization:
                module.config.init_method(sinks)


def every_param_decayed() -> dict[str, Any]:
    """`get_megatron_optimizer`'s keywords for weight decay on every param alike (no exemption of
    biases and norms, as the engine's AdamW decays them): `config_overrides={}` (0.16 on), else
    `no_weight_decay_cond` answering False for every param (the default exempts biases and 1-D
    params: 0.15's `_get_param_groups`)."""
    from megatron.core.optimizer import get_megatron_optimizer

    if _takes(get_megatron_optimizer, "config_overrides"):
        return {"config_overrides": {}}
    return {"no_weight_decay_cond": lambda name, param: False}


def cp_batch_arguments() -> dict[str, Any]:
    """`get_batch_on_this_cp_rank`'s keywords beyond the batch: the CP group by name (0.15-0.16
    fall back to parallel_state's CP group without it, 0.17 on to the whole world), and from 0.17
    `is_hybrid_cp=False` (required there: megatron's plain load-balanced split, no hybrid CP)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    arguments: dict[str, Any] = {}
    if _takes(get_batch_on_this_cp_rank, "cp_group"):
        arguments["cp_group"] = parallel_state.get_context_parallel_group()
    if _takes(get_batch_on_this_cp_rank, "is_hybrid_cp"):
        arguments["is_hybrid_cp"] = False
    return arguments


__all__ = ["RELEASES", "cp_batch_arguments", "every_param_decayed", "gated_fc1_stride", "initialise_sinks", "missing",
           "reference_parallel_state"]
