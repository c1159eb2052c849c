"""Stage: step. torchtitan's releases: the range this integration supports and what differs
inside it, asked as capabilities (sp_harness.cases.frameworks.releases).

Everything else in the package asks this module, never a version string. Importing it imports no
framework code; `missing()` does (the driver asks it in a child interpreter, after the package's
CPU shim for torchtitan's triton kernels: torchtitan_case.cpu_shims).

The range is one release (docs/frameworks/torchtitan.md, "Releases"). Every release on PyPI
installs with torch 2.13.0 on Python 3.11; what the integration drives exists only in 0.3.0:
- 0.3.0 builds a model from a declarative config (`Llama3Model.Config` of
  `_build_llama3_layers`), sets torchtitan's own sharding config on it
  (`set_llama3_sharding_config`) and parallelizes it with `Module.parallelize(ParallelDims)` on
  a chosen SPMD backend (DTensor, or spmd_types), with `apply_fsdp_to_decoder`, the CP helpers
  and `Trainer.train_step` over them;
- 0.1.0 to 0.2.2 build `Transformer(TransformerModelArgs)` and apply TP with hand-written
  `parallelize_module` plans in `parallelize_llama(model, parallel_dims, job_config)` (separate
  wq / wk / wv, no sharding config, no spmd_types, another trainer): not one API renamed but
  another way of building and sharding a model, which this integration does not drive;
- 0.0.2 is an empty placeholder wheel (no `torchtitan` package).
"""

from __future__ import annotations

import importlib

from sp_harness.cases.frameworks.releases import ReleaseRange, api_gaps

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="torchtitan", oldest="0.3.0", newest="0.3.0",
                 note="0.2.2 and older build and shard models through another API: Transformer, "
                      "parallelize_llama"),
)
"""Supported releases, both ends included: each one's framework tests pass (docs/frameworks/
torchtitan.md, "Releases"; the release matrix: tox -m releases-torchtitan)."""

APIS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # the registry models' configs and their sharding configs
    ("torchtitan.models.llama3", "_build_llama3_layers", ("fuse_qkv", "n_layers", "dim", "n_heads", "n_kv_heads",
                                                          "hidden_dim", "rope", "attn_backend")),
    ("torchtitan.models.llama3", "Llama3Model", ()),
    ("torchtitan.models.llama3", "compute_ffn_hidden_dim", ("multiple_of", "ffn_dim_multiplier")),
    ("torchtitan.models.llama3.sharding", "set_llama3_sharding_config", ("enable_sp",)),
    ("torchtitan.models.qwen3", "_build_qwen3_layers", ()),
    ("torchtitan.models.qwen3.sharding", "set_qwen3_sharding_config", ("enable_sp", "enable_ep")),
    ("torchtitan.models.deepseek_v3", "_build_dsv3_layers", ()),
    ("torchtitan.models.deepseek_v3.sharding", "set_deepseek_v3_sharding_config", ("enable_sp", "enable_ep")),
    ("torchtitan.models.common", "ComplexRoPE", ()),
    ("torchtitan.models.common", "CosSinRoPE", ()),
    ("torchtitan.models.common.attention", "ScaledDotProductAttention", ()),
    ("torchtitan.models.common.decoder_sharding", "dense_activation_placement", ()),
    ("torchtitan.protocols.module", "Module", ()),
    # the parallelize_* functions and the parallel dims they read
    ("torchtitan.distributed", "ParallelDims", ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "world_size",
                                                "spmd_backend")),
    ("torchtitan.distributed.parallel_dims", "MeshAxisName", ()),
    ("torchtitan.distributed.utils", "set_spmd_backend", ()),
    ("torchtitan.distributed.utils", "clip_grad_norm_", ("max_norm", "foreach", "pp_mesh", "ep_enabled")),
    ("torchtitan.distributed.fsdp", "apply_fsdp_to_decoder", ("param_dtype", "reduce_dtype", "pp_enabled")),
    ("torchtitan.distributed.fsdp", "disable_fsdp_gradient_division", ()),
    ("torchtitan.distributed.spmd_types", "annotate_input_spmd_types", ()),
    ("torchtitan.distributed.spmd_types", "set_current_spmd_mesh", ()),
    # the CP helpers
    ("torchtitan.distributed.context_parallel", "prepare_context_parallel_input", ()),
    ("torchtitan.distributed.context_parallel", "apply_cp_to_forward", ()),
    # the trainer step, its loss and its optimizer container
    ("torchtitan.trainer", "Trainer", ()),
    ("torchtitan.components.loss", "CrossEntropyLoss", ()),
    ("torchtitan.components.loss", "cross_entropy_loss", ()),
    ("torchtitan.components.optimizer.optimizer", "OptimizersContainer", ()),
    ("torchtitan.components.optimizer.optimizer", "ParamGroupConfig", ()),
)
"""(module, name, keyword parameters) of each API the integration calls: the name must be there,
and take those parameters (by `inspect.signature`)."""

TRAINER_STEP = ("train_step", "forward_backward_step", "post_dataloading_process", "_forward_backward_body")
"""The `Trainer` methods the step case binds (torchtitan_step)."""


def missing() -> tuple[str, ...]:
    """Each API this integration needs that the installed release lacks, named as a user would
    look it up."""
    from sp_harness.cases.frameworks.torchtitan.case import cpu_shims

    cpu_shims()
    try:
        importlib.import_module("torchtitan")
    except Exception as exc:  # a broken install raises whatever it raises
        return (f"an import of torchtitan that works (it raised {type(exc).__name__}: {exc})",)
    gaps, modules = api_gaps(APIS)
    trainer = getattr(modules.get("torchtitan.trainer"), "Trainer", None)
    if trainer is not None:
        gaps += [f"torchtitan.trainer.Trainer.{m}" for m in TRAINER_STEP if not hasattr(trainer, m)]
    model = getattr(modules.get("torchtitan.protocols.module"), "Module", None)
    if model is not None and not hasattr(model, "parallelize"):
        gaps.append("torchtitan.protocols.module.Module.parallelize")
    try:
        importlib.import_module("spmd_types")
    except ImportError:
        gaps.append("spmd_types (the SPMD types backend torchtitan 0.3.0 requires)")
    return tuple(gaps)
