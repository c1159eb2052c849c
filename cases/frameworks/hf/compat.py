"""Stage: step. The HF Trainer's releases: the range this integration supports and what differs
inside it, asked as capabilities (sp_harness.cases.frameworks.releases).

Everything else in the package asks this module, never a version string. Importing it imports no
framework code; every function but `RELEASES` does (the driver asks `missing()` in a child
interpreter; the step asks the others on its rank).

What differs inside the range, as the step meets it (docs/frameworks/hf-trainer.md):

- The loop's shape (`trainer_loop`): transformers 4.45 steps through `accelerator.accumulate`
  one batch at a time (`ACCUMULATE`); 4.46 to 5.2 prefetch the K micro-batches of an optimizer
  step with `get_batch_samples`, which counts their tokens (`num_items_in_batch`), all inline in
  `_inner_training_loop` (`BATCH_SAMPLES`); 5.3 on split that function into
  `_init_training_state`, `_prepare_for_training` and `_run_epoch`, with the clipping and the
  norm in `_clip_grad_norm` / `_get_grad_norm` (`RUN_EPOCH`).
- `get_batch_samples` takes the device in later releases (4.50 does, 4.48 not); `training_step`
  passes `num_items_in_batch` from 4.46 on; `TrainingArguments(average_tokens_across_devices=)`
  and `Trainer(compute_loss_func=)` exist from 4.46 on.
- The log's signature (`start_time` from 4.47, `learning_rate` later: 4.53 has it, 4.50 not),
  the state's helpers (`compute_steps`, `init_training_references`: 4.50 has them, 4.48 not), the
  log's gather (`_nested_gather` to 5.1), the scheduler created after `accelerator.prepare` (5.1
  on) and the schedulers the loop does not step (GreedyLR too in later 5.x).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from sp_harness.cases.frameworks.releases import ReleaseRange

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="transformers", oldest="4.45.0", newest="5.23.0"),
    ReleaseRange(distribution="accelerate", oldest="0.26.0", newest="1.15.0",
                 note="0.26.0 runs transformers 4.45 to 4.50; a later Trainer (4.53 on, not 4.50) needs 1.3.0"),
)
"""Supported releases, both ends included: each end's framework tests and release cases pass
(docs/frameworks/hf-trainer.md, the release matrix). accelerate's oldest is what transformers 4.45
asks for (`ACCELERATE_MIN_VERSION` 0.26.0); later Trainers need more than they declare (4.53 to
5.23, not 4.50, ask for 0.26.0 / 1.1.0 but pass `unwrap_model(keep_torch_compile=)`, accelerate 1.3.0's:
`missing()` names it where the installed accelerate lacks it). Each installs with torch 2.13.0 on
Python 3.11."""

ACCUMULATE = "accumulate"
"""transformers 4.45: `_inner_training_loop` steps per batch under `accelerator.accumulate(model)`,
`training_step(model, inputs)`; the Trainer divides each micro-batch's loss by K."""
BATCH_SAMPLES = "batch-samples"
"""4.46 to 5.2: `_inner_training_loop` takes each optimizer step's K micro-batches from
`get_batch_samples` (and their token count), `training_step(model, inputs, num_items_in_batch)`
under `no_sync` but for the last, clipping with `accelerator.clip_grad_norm_` inline."""
RUN_EPOCH = "run-epoch"
"""5.3 on: the same loop body in `_run_epoch`, set up by `_init_training_state` and
`_prepare_for_training`, clipping with `_clip_grad_norm` and the norm from `_get_grad_norm`."""
LOOPS = (ACCUMULATE, BATCH_SAMPLES, RUN_EPOCH)

_TRAINING_ARGUMENTS = ("output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
                       "lr_scheduler_type", "max_grad_norm", "optim", "adam_beta1", "adam_beta2", "adam_epsilon",
                       "weight_decay", "use_cpu", "ddp_backend", "report_to", "logging_steps", "save_strategy",
                       "eval_strategy", "disable_tqdm", "seed", "max_steps", "label_smoothing_factor",
                       "logging_nan_inf_filter")
"""The `TrainingArguments` fields the step sets or reads, on every release of the range."""

_EVERY_LOOP = ("training_step", "compute_loss", "floating_point_ops", "remove_callback", "get_decay_parameter_names",
               "_maybe_log_save_evaluate", "_get_learning_rate", "_wrap_model", "create_optimizer")
_PER_LOOP: dict[str, tuple[str, ...]] = {
    ACCUMULATE: ("create_optimizer_and_scheduler",),
    BATCH_SAMPLES: ("create_optimizer_and_scheduler", "get_batch_samples"),
    RUN_EPOCH: ("_init_training_state", "_prepare_for_training", "get_batch_samples", "_clip_grad_norm",
                "_get_grad_norm", "_track_num_input_tokens"),
}
"""The `Trainer` methods each loop shape's replay calls (sp_harness.cases.frameworks.hf.step)."""

_ACCELERATOR = ("accumulate", "no_sync", "clip_grad_norm_", "backward", "prepare", "gather")


def _trainer() -> Any:
    from transformers import Trainer

    return Trainer


def trainer_loop() -> str:
    """The installed Trainer's loop shape: `ACCUMULATE`, `BATCH_SAMPLES` or `RUN_EPOCH`."""
    trainer = _trainer()
    if hasattr(trainer, "_run_epoch"):
        return RUN_EPOCH
    return BATCH_SAMPLES if hasattr(trainer, "get_batch_samples") else ACCUMULATE


def averages_tokens_across_devices() -> bool:
    """Whether `TrainingArguments(average_tokens_across_devices=)` exists (the step sets it True:
    `num_items_in_batch` gathered over the ranks, the loss x the ranks)."""
    from transformers import TrainingArguments

    return "average_tokens_across_devices" in {f.name for f in dataclasses.fields(TrainingArguments)}


def takes_compute_loss_func() -> bool:
    """Whether `Trainer(compute_loss_func=)` exists."""
    return "compute_loss_func" in inspect.signature(_trainer().__init__).parameters


def reads_loss_is_scaled_for_ga() -> bool:
    """Whether `training_step` asks the Trainer's `loss_is_scaled_for_ga` before dividing the loss
    by the accumulation steps (5.23.0 has it; 5.3.0 has not, and divides wherever the model takes
    no loss kwargs, which the Trainer sets under SP)."""
    return hasattr(_trainer(), "loss_is_scaled_for_ga")


def scaled_loss_missing() -> tuple[str, ...]:
    """What a compute_loss that scales its own loss for accumulation (the SP token-mean fixes) needs
    and the installed Trainer lacks: () or the one API (a `releases.probe` function)."""
    return () if reads_loss_is_scaled_for_ga() else ("Trainer.loss_is_scaled_for_ga",)


def passes_num_items_in_batch() -> bool:
    """Whether the loop hands `training_step` the optimizer step's token count (and the base
    `compute_loss` takes it): where not, a `compute_loss` written for it gets None."""
    return "num_items_in_batch" in inspect.signature(_trainer().training_step).parameters


def batch_samples_take_device() -> bool:
    """Whether `get_batch_samples(epoch_iterator, num_batches, device)` takes the device."""
    return "device" in inspect.signature(_trainer().get_batch_samples).parameters


def log_parameters() -> frozenset[str]:
    """The parameters of `Trainer._maybe_log_save_evaluate` (`start_time`, `learning_rate` came
    later): the step passes each the loop passes where the installed one takes it."""
    return frozenset(inspect.signature(_trainer()._maybe_log_save_evaluate).parameters)


def log_gather(trainer: Any) -> Callable[[Any], Any]:
    """What the log gathers `tr_loss` over the ranks with: `trainer._nested_gather` (to 5.1) or
    `trainer_pt_utils.nested_gather(tensor, parallel_mode)` (5.2 on)."""
    if hasattr(trainer, "_nested_gather"):
        return trainer._nested_gather
    from transformers.trainer_pt_utils import nested_gather

    return lambda tensor: nested_gather(tensor, trainer.args.parallel_mode)


def schedulers_not_stepped() -> tuple[type, ...]:
    """The lr schedulers the loop does not step after the optimizer (stepped on metrics instead):
    ReduceLROnPlateau, and transformers' GreedyLR where it has one (later 5.x)."""
    import torch
    import transformers.optimization

    greedy = getattr(transformers.optimization, "GreedyLR", None)
    return (torch.optim.lr_scheduler.ReduceLROnPlateau, *((greedy,) if greedy is not None else ()))


def state_computes_steps() -> bool:
    """Whether `TrainerState.compute_steps` exists (else the loop sets logging/eval/save steps inline)."""
    from transformers.trainer_callback import TrainerState

    return hasattr(TrainerState, "compute_steps")


def state_inits_references() -> bool:
    """Whether `TrainerState.init_training_references` exists (else the loop sets the callback
    handler's references and the state's max_steps, epochs and process flags inline)."""
    from transformers.trainer_callback import TrainerState

    return hasattr(TrainerState, "init_training_references")


def scheduler_after_prepare() -> bool:
    """Whether the loop creates the lr scheduler after `accelerator.prepare` (`create_optimizer`,
    prepare, then `create_scheduler`: 5.1 on) rather than with the optimizer before it
    (`create_optimizer_and_scheduler`), read from the installed `_inner_training_loop`'s code:
    the set-up is inline there before 5.3, so no attribute tells."""
    if trainer_loop() == RUN_EPOCH:
        return True
    return "self.create_scheduler(" in inspect.getsource(_trainer()._inner_training_loop)


def missing() -> tuple[str, ...]:
    """Each API this integration needs that the installed release lacks, named as a user would
    look it up."""
    try:
        from transformers import PrinterCallback, Trainer, TrainingArguments  # noqa: F401
        from transformers.trainer_callback import ExportableState, TrainerState  # noqa: F401
    except ImportError as exc:
        return (f"transformers' Trainer, PrinterCallback, TrainingArguments, TrainerState and ExportableState "
                f"(importing them raised {type(exc).__name__}: {exc})",)
    from accelerate import Accelerator

    gaps = [f"TrainingArguments({name}=)" for name in _TRAINING_ARGUMENTS
            if name not in {f.name for f in dataclasses.fields(TrainingArguments)}]
    loop = trainer_loop()
    gaps += [f"Trainer.{name}" for name in (*_EVERY_LOOP, *_PER_LOOP[loop]) if not hasattr(Trainer, name)]
    gaps += [f"accelerate.Accelerator.{name}" for name in _ACCELERATOR if not hasattr(Accelerator, name)]
    if loop != ACCUMULATE and not passes_num_items_in_batch():
        gaps.append("Trainer.training_step(model, inputs, num_items_in_batch)")
    if "stateful_callbacks" not in inspect.signature(TrainerState).parameters:
        gaps.append("TrainerState(stateful_callbacks=)")
    gaps += [f"accelerate.Accelerator.{method}({keyword}=) (the Trainer passes it{why})"
             for method, keyword, why in _accelerate_keywords_called() if
             keyword not in inspect.signature(getattr(Accelerator, method)).parameters]
    return tuple(gaps)


def sp_missing() -> tuple[str, ...]:
    """What the Trainer's sequence-parallel path (sp_harness.cases.frameworks.hf.sp) needs that
    the installed transformers, accelerate or DeepSpeed lack: accelerate's ParallelismConfig with an
    SP backend and its Ulysses handler, the Trainer's SP loss and its dataloader hook, DeepSpeed's
    Ulysses for HF (`UlyssesSPAttentionHF`, `UlyssesSPDataLoaderAdapter`), and the 5.3-on loop
    (`_prepare_for_training` is where the Trainer wraps its dataloader in the adapter)."""
    gaps = list(missing())
    try:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig  # noqa: F401
    except ImportError as exc:
        return (*gaps, f"accelerate's ParallelismConfig and DeepSpeedSequenceParallelConfig ({exc})")
    if "sp_backend" not in {f.name for f in dataclasses.fields(ParallelismConfig)}:
        gaps.append("accelerate ParallelismConfig(sp_backend=)")
    from accelerate import Accelerator

    if not hasattr(Accelerator, "deepspeed_ulysses_dl_adapter"):
        gaps.append("accelerate.Accelerator.deepspeed_ulysses_dl_adapter")
    import transformers.integrations.deepspeed as hf_deepspeed

    if not hasattr(hf_deepspeed, "deepspeed_sp_compute_loss"):
        gaps.append("transformers.integrations.deepspeed.deepspeed_sp_compute_loss")
    if "parallelism_config" not in {f.name for f in dataclasses.fields(_training_arguments())}:
        gaps.append("TrainingArguments(parallelism_config=)")
    if trainer_loop() != RUN_EPOCH:
        gaps.append("Trainer._prepare_for_training (transformers 5.3 on)")
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import (  # noqa: F401
            UlyssesSPAttentionHF,
            UlyssesSPDataLoaderAdapter,
        )
    except ImportError as exc:
        gaps.append(f"DeepSpeed's UlyssesSPAttentionHF and UlyssesSPDataLoaderAdapter ({type(exc).__name__}: {exc})")
    return tuple(gaps)


def _training_arguments() -> Any:
    from transformers import TrainingArguments

    return TrainingArguments


_CALLED_KEYWORDS = (("unwrap_model", "keep_torch_compile", "; accelerate 1.3.0 has it"),)
"""accelerate keywords a later Trainer passes that its declared accelerate requirement does not
guarantee (transformers 4.53 to 5.23, not 4.50, ask for accelerate >= 0.26.0 / 1.1.0 and pass
`unwrap_model(keep_torch_compile=)`, which came in accelerate 1.3.0: with an older one the Trainer
raises TypeError in its set-up)."""


def _accelerate_keywords_called() -> tuple[tuple[str, str, str], ...]:
    """Those of `_CALLED_KEYWORDS` the installed trainer.py passes, read from its code."""
    import transformers.trainer

    source = inspect.getsource(transformers.trainer)
    return tuple(entry for entry in _CALLED_KEYWORDS if f"{entry[1]}=" in source)
