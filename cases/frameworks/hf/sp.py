"""Stage: step. The HF Trainer's sequence parallelism: accelerate's `ParallelismConfig(sp_size=,
sp_backend="deepspeed")`, whose backend is DeepSpeed's Ulysses / ALST (`UlyssesSPAttentionHF`
registered by accelerate's `prepare`, `UlyssesSPDataLoaderAdapter` wrapped around the Trainer's
dataloader, the DeepSpeed engine with DeepSpeed's SP groups as its `mpu`), set up as a user does:
`TrainingArguments(deepspeed=..., parallelism_config=...)`. `TrainerStep` runs it when the run has
SP > 1 (world size / dp); what is here is what that path adds to the DDP one.

What the Trainer's own code does on this path (transformers 5.23.0, accelerate 1.15.0, DeepSpeed
0.19.8), all run as shipped:

- Data: each rank's dataloader hands the adapter one batch of whole sequences; the adapter
  all-gathers the SP group's batches and yields them one after another, each sequence-sharded over
  the group, with `labels` replaced by `shift_labels` (labels[..., 1:], -100 padded). So one
  dataloader batch per SP rank makes SP micro-steps, and the K micro-steps of an optimizer step are
  the group's K sequences-batches in SP-rank order. The feed (`Feed`) is that dataloader: for the
  check's K micro-batches of this DP replica, SP rank j hands over micro-batches j, j + SP, ...,
  so the group processes micro-batch 0, 1, ..., K - 1 in order (K a multiple of SP: the adapter
  gathers one batch from every SP rank per round).
- The collator (`collate`): position_ids (the adapter refuses batches without them), no
  attention_mask (Ulysses takes none: causal attention over position_ids), each sequence right-
  padded to a multiple of SP with pad tokens whose labels are -100 (a collator's
  `pad_to_multiple_of`): in a causal LM a pad after every valid token changes no valid token's
  logits.
- Loss: `Trainer.compute_loss` calls `deepspeed_sp_compute_loss` (the model's per-shard token mean,
  weighted by each SP rank's valid tokens, gathered differentiably over the SP group); the Trainer
  sets `model_accepts_loss_kwargs = False` here and `training_step` divides by K. The engine steps
  inside `accelerator.backward` at the boundary (accelerate's `DeepSpeedEngineWrapper.backward`:
  `engine.backward` then `engine.step()`), and clips there (`gradient_clipping`).
- Reading the grads: the check reads them between the K-th backward and DeepSpeed's boundary
  `engine.step()`, as it does for DeepSpeed's own step (`deepspeed.utils.safe_get_full_grad`). So
  the boundary `engine.step()` that accelerate calls at the end of the last backward is deferred
  (`DeferredStep`) to the start of `TrainerStep.step`, the next thing that runs: nothing between
  the two touches the grads or the params but the check's read, so the order of every call the
  Trainer, accelerate and DeepSpeed make is unchanged.
- CPU: DeepSpeed on its CPU accelerator over gloo (sp_harness.cases.frameworks.deepspeed.runtime:
  its comm backend without the shm op), and the torch collective shims (`shims`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from sp_harness import RankContext
from sp_harness.config.step_protocol import MicroBatch

PAD_ID = 0
IGNORE_INDEX = -100


def collate(micro_batch: MicroBatch, sp: int) -> dict[str, torch.Tensor]:
    """A data collator's batch for the SP path (module doc): input_ids, labels and position_ids,
    right-padded to a multiple of `sp`."""
    ids = micro_batch.inputs["input_ids"]  # (B, S)
    labels = micro_batch.target  # (B, S)
    pad = -ids.shape[1] % sp
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad), value=PAD_ID)
        labels = torch.nn.functional.pad(labels, (0, pad), value=IGNORE_INDEX)
    positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


class Feed:
    """The dataloader the Trainer's SP adapter wraps: this rank's batches of the current optimizer
    step, in the order `TrainerStep` puts them. Its own iterator; exhausted between steps, which the
    adapter never reaches (it draws one batch per SP micro-steps, K / SP per step)."""

    def __init__(self) -> None:
        self.queue: deque[dict[str, torch.Tensor]] = deque()

    def put(self, batches: Sequence[dict[str, torch.Tensor]]) -> None:
        self.queue.extend(batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self.queue:
            raise StopIteration
        return self.queue.popleft()

    def __len__(self) -> int:
        return len(self.queue)


def mine(micro_batches: Sequence[MicroBatch], ctx: RankContext) -> list[MicroBatch]:
    """The micro-batches this SP rank's dataloader hands the adapter (module doc: j, j + SP, ...)."""
    return list(micro_batches[ctx.tp_rank::ctx.tp])


def arguments(ctx: RankContext, zero_stage: int) -> dict[str, Any]:
    """The `TrainingArguments` a user adds for SP: a DeepSpeed config of "auto" values (the Trainer
    fills them from its own arguments) at `zero_stage`, and accelerate's ParallelismConfig with the
    run's SP size over DeepSpeed's Ulysses (sdpa as the core attention, sequences of any length)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    dtype = ctx.config.torch_dtype
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": zero_stage},
                 "bf16": {"enabled": "auto"},
                 # the Trainer's torch optimizer (SGD, AdamW) as the engine's client optimizer
                 "zero_allow_untested_optimizer": True}
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    parallelism = ParallelismConfig(sp_size=ctx.tp, sp_backend="deepspeed", dp_shard_size=ctx.dp, sp_handler=handler)
    return {"deepspeed": ds_config, "parallelism_config": parallelism, "bf16": dtype == torch.bfloat16}


class DeferredStep:
    """The DeepSpeed engine's boundary `step()`, which accelerate calls at the end of the last
    micro-batch's backward, held until `run()` (module doc: the check reads the grads between)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.own = engine.step
        self.pending = False

        def held(*args: Any, **kwargs: Any) -> None:
            assert not args and not kwargs, "accelerate's DeepSpeedEngineWrapper calls engine.step()"
            self.pending = True

        engine.step = held

    def run(self) -> None:
        """The held boundary step, where one is held (the optimizer step, its clipping, its zero_grad)."""
        if self.pending:
            self.pending = False
            self.own()

    def drop(self) -> None:
        """An accumulation dropped without stepping (`TrainerStep.zero_grad`)."""
        self.pending = False


ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
"""accelerate's switch to DeepSpeed, which `reset_process` clears for a DDP job."""

_LAST_SP = [1]
"""The SP size of this process's last Trainer job (1: none yet, or the Trainer's DDP)."""


def reset_process(sp: int) -> None:
    """Where this job (SP `sp`) or this process's last one is an SP job, start from what a new
    process has: no accelerate state (an SP job's holds its DeepSpeed plugin and ParallelismConfig)
    and, after an SP job, transformers' own sdpa and no DeepSpeed SP groups. DDP jobs after DDP
    jobs share accelerate's state as they always have.

    A DDP job also starts without ACCELERATE_USE_DEEPSPEED: accelerate's `Accelerator` sets it
    whenever it is given a DeepSpeed plugin (accelerator.py 1.12.0 line 368) and nothing unsets it,
    so an SP job left it for the next job, whose `TrainingArguments` then built a DeepSpeed plugin
    of their own (training_args.py 5.23.0 line 1716): the DDP case ran DeepSpeed's engine, not the
    Trainer's DDP step (and crashed in it once a DeepSpeed job had released its SP groups)."""
    last, _LAST_SP[0] = _LAST_SP[0], sp
    if sp == 1:
        os.environ.pop(ACCELERATE_USE_DEEPSPEED, None)
    if sp == 1 and last == 1:
        return
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if last > 1:
        from sp_harness.cases.frameworks.deepspeed.hf import reset_ulysses_hf

        reset_ulysses_hf("sdpa")


def prepare_process(ctx: RankContext) -> None:
    """This rank's DeepSpeed comm backend over the harness's gloo world and the torch collective
    shims (`shims`); transformers' own sdpa recorded before accelerate's `prepare` replaces it by
    DeepSpeed's wrapper, so that the next job in this process starts from it (`reset_process`)."""
    from sp_harness.cases.frameworks.deepspeed.hf import reset_ulysses_hf
    from sp_harness.cases.frameworks.deepspeed.runtime import init_distributed
    from sp_harness.cases.frameworks.hf.shims import gloo_all_to_all_by_group_rank, gloo_uneven_all_gather

    init_distributed()
    gloo_all_to_all_by_group_rank()
    gloo_uneven_all_gather()
    reset_ulysses_hf("sdpa")


def check_groups(ctx: RankContext) -> None:
    """DeepSpeed's SP group, as accelerate made it, is the harness's SP group."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    theirs = tuple(dist.get_process_group_ranks(groups._get_sequence_parallel_group()))
    if theirs != tuple(ctx.tp_ranks):
        raise RuntimeError(f"DeepSpeed's SP group {theirs} (accelerate's ParallelismConfig) is not the "
                           f"harness's {tuple(ctx.tp_ranks)}")


__all__ = ["DeferredStep", "Feed", "arguments", "check_groups", "collate", "mine", "prepare_process", "reset_process"]
