"""Stage: step. verl's releases: the range this integration supports and the APIs it calls, asked
as capabilities (sp_harness.cases.frameworks.releases).

Everything else in the package asks this module, never a version string. Importing it imports no
framework code; `missing()` does (the driver asks it in a child interpreter, from each case's
`validate`).

The range is the one release verified here, verl 0.9.1, on the project's transformers 5.23.0
(verl 0.9.1 declares transformers < 5.11; every call the SFT step makes runs unchanged on
5.23.0: docs/frameworks/verl.md). What the step calls, by module:

- `verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead`: its constructor, `initialize`,
  `train_mode`, `optimizer_zero_grad`, `forward_backward_batch`, `optimizer_step`,
  `lr_scheduler_step`, `get_data_parallel_group / _rank / _size`, and the attributes the step
  reads (`module`, `optimizer`, `ulysses_parallel_group`, `ulysses_device_mesh`).
- `verl.workers.config`: `HFModelConfig(load_tokenizer=, use_remove_padding=, override_config=)`,
  `FSDPEngineConfig(strategy=, ulysses_sequence_parallel_size=, model_dtype=, mixed_precision=)`,
  `FSDPOptimizerConfig`; `verl.trainer.config.CheckpointConfig`.
- `verl.workers.utils.losses.sft_loss`; `verl.utils.dataset.dataset_utils.SFTTensorCollator` and
  `DatasetPadMode`; `verl.utils.tensordict_utils.get_tensordict / assign_non_tensor`.
- The Ulysses path the engine takes: `verl.utils.ulysses.ulysses_pad_and_slice_inputs`,
  `gather_outputs_and_unpad`; `verl.models.transformers.monkey_patch.apply_monkey_patch`,
  `_ulysses_flash_attention_forward` and the module-level `_flash_attention_forward` and
  `is_trl_available` it calls (the shims replace the last two: `shims`).
- The CPU platform: `verl.plugin.platform.platform_manager.set_platform`, `PlatformBase`.
"""

from __future__ import annotations

from sp_harness.cases.frameworks.releases import ReleaseRange, api_gaps

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="verl", oldest="0.9.1", newest="0.9.1",
                 note="installed with --no-deps: its metadata asks transformers < 5.11, the project pins 5.23.0"),
)
"""Supported releases, both ends included: the one whose SFT step the tests verify."""

APIS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("verl.plugin.platform.platform_manager", "set_platform", ()),
    ("verl.plugin.platform.platform_base", "PlatformBase", ()),
    ("verl.models.transformers.monkey_patch", "apply_monkey_patch", ("ulysses_sp_size", "use_remove_padding")),
    ("verl.models.transformers.monkey_patch", "_ulysses_flash_attention_forward", ()),
    ("verl.models.transformers.monkey_patch", "_flash_attention_forward", ()),
    ("verl.models.transformers.monkey_patch", "is_trl_available", ()),
    ("verl.utils.ulysses", "ulysses_pad_and_slice_inputs", ()),
    ("verl.utils.ulysses", "gather_outputs_and_unpad", ()),
    ("verl.utils.ulysses", "get_ulysses_sequence_parallel_group", ()),
    ("verl.workers.utils.losses", "sft_loss", ()),
    ("verl.utils.dataset.dataset_utils", "SFTTensorCollator", ()),
    ("verl.utils.dataset.dataset_utils", "DatasetPadMode", ()),
    ("verl.utils.tensordict_utils", "get_tensordict", ()),
    ("verl.utils.tensordict_utils", "assign_non_tensor", ()),
    ("verl.workers.config", "HFModelConfig", ("load_tokenizer", "use_remove_padding", "override_config")),
    ("verl.workers.config", "FSDPEngineConfig", ("strategy", "ulysses_sequence_parallel_size", "model_dtype",
                                                  "mixed_precision")),
    ("verl.workers.config", "FSDPOptimizerConfig", ("optimizer", "override_optimizer_config", "clip_grad")),
    ("verl.trainer.config", "CheckpointConfig", ()),
)
"""(module, name, keywords it must take) for each API the step calls outside the engine class."""

ENGINE_METHODS = ("initialize", "train_mode", "optimizer_zero_grad", "forward_backward_batch", "optimizer_step",
                  "lr_scheduler_step", "get_data_parallel_group", "get_data_parallel_rank",
                  "get_data_parallel_size", "_init_device_mesh", "_build_fsdp_module")
"""`FSDPEngineWithLMHead`'s methods the step (and the mutants' engine overrides) call."""


def missing() -> tuple[str, ...]:
    """Each API this integration needs that the installed verl lacks, named as a user would look
    it up (the platform is set first, as the step sets it: the engine module reads it at import)."""
    try:
        from sp_harness.cases.frameworks.verl import shims

        shims.cpu_shims()
    except Exception as exc:  # a broken install raises whatever it raises
        return (f"an import of verl that works (it raised {type(exc).__name__}: {exc})",)
    gaps, modules = api_gaps((*APIS, ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead", ())))
    engine = getattr(modules.get("verl.workers.engine.fsdp.transformer_impl"), "FSDPEngineWithLMHead", None)
    if engine is not None:
        gaps += [f"FSDPEngineWithLMHead.{m}" for m in ENGINE_METHODS if not hasattr(engine, m)]
    return tuple(gaps)


__all__ = ["APIS", "ENGINE_METHODS", "RELEASES", "missing"]
