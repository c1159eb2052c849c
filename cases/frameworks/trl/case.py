"""Stage: step. TRL's `SFTTrainer` as a system under test, judged by the training-step check:

    from sp_harness.cases.frameworks.trl.case import SFTSetup, sft_trainer_case
    MY_SFT = sft_trainer_case("my-sft", SFTSetup(trainer_class=MySFTTrainer))

The SFTTrainer is a transformers `Trainer` subclass, so the step is the HF integration's
`TrainerStep` (sp_harness.cases.frameworks.hf.step: the installed Trainer's own loop, line for
line, under DDP or under accelerate's SP over DeepSpeed's Ulysses), with TRL's Trainer in it
(`SFTFlavour`). What TRL adds runs as shipped:

- Arguments: an `SFTConfig` (the Trainer's arguments, `bf16` as they set it, not TRL's default
  of True, plus `completion_only_loss`; TRL's `gradient_checkpointing=True` kept; and under SP
  `pad_to_multiple_of` = SP, which accelerate's SP docs ask of a collator: the adapter shards
  every sequence into SP equal pieces) and a tokenizer (`tokenizer`: a word-level one whose
  token i is id i, built offline, since the SFTTrainer needs one for its pad token).
- Data: each step's rows go through the SFTTrainer's own dataset preparation
  (`_prepare_dataset`, what its `__init__` runs on `train_dataset`: the labels built from the
  `completion_mask`, -100 on the prompt, truncation to `max_length`; the rows it drops, those with
  no completion token, come back fully masked: `SFTFlavour.batches`)
  and its own collator (`DataCollatorForLanguageModeling`: right padding, labels -100 there;
  under SP `position_ids`, which the SFTTrainer switches on). A row is a pre-tokenized
  prompt-completion example: the engine's sequence without its pads, `completion_mask` 1 where
  the engine's target carries loss.
- Loss: DDP, the SFTTrainer's own `compute_loss` (its fused LM head, `-log_probs.sum()` over
  `num_items_in_batch`, x the DP world); SP, what the SFTTrainer does there: the Trainer's own SP
  loss over the fused head (`super().compute_loss(..., fused_lm_head=True)`), which is the
  Trainer's mean of SP-group means (sp_harness.cases.frameworks.hf.cases `SP_LOSS_BUG`), unless
  the user's code fixes it (sp_harness.cases.frameworks.trl.cases `SFTSPTokenMean`).
- The reference is the HF integration's: the same LM in float64 on one device, HF's shifted
  token loss over every valid token of the global batch.

Not run: packing (TRL's bfd packing is padding-free, whose documents must not attend across their
boundaries, which only a varlen (flash) attention enforces: CUDA), PEFT, vision datasets, chat
templates (the rows are pre-tokenized; a template changes which tokens are there, not the step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from sp_harness import Case
from sp_harness.cases.frameworks import releases
from sp_harness.cases.frameworks.hf.case import IGNORE_INDEX, PAD_ID, HFTrainerSetup, hf_trainer_case
from sp_harness.config.step_protocol import MicroBatch

TRL_VERSION = "1.16.0"
"""The release the `trl` extra pins (`compat.RELEASES`)."""

PLACEHOLDER = {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}
"""The one-row `train_dataset` the SFTTrainer requires at construction: the engine hands each step's
rows to the feed instead (the Trainer's dataloader over it is never built)."""


@dataclass(kw_only=True, frozen=True)
class SFTSetup:
    """What a `sft_trainer_case` trains: the model and the user's SFTTrainer code."""

    model: str = "llama"
    """'llama' (LlamaForCausalLM) or 'qwen2' (Qwen2ForCausalLM)."""
    trainer_class: type | None = None
    """A `trl.SFTTrainer` subclass whose overrides run as written, or a plain class of such methods
    mixed in before it on the rank. None: `trl.SFTTrainer`."""
    completion_only_loss: bool = True
    """SFTConfig(completion_only_loss=): the loss only on the completion (the `completion_mask`);
    False trains on the prompt too, which the reference does not (its labels mask the prompt)."""
    max_pad: int = 3
    """Each sequence ends in 0..max_pad pad tokens, which the rows leave out (TRL pads again)."""
    zero_stage: int = 1
    """Under SP: the DeepSpeed config's ZeRO stage, 0, 1 or 2 (HFTrainerSetup.zero_stage)."""

    def hf(self) -> HFTrainerSetup:
        """The Trainer set-up underneath (validates the shared fields)."""
        return HFTrainerSetup(model=self.model, trainer_class=self.trainer_class, max_pad=self.max_pad,
                              zero_stage=self.zero_stage)


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over `vocab` ids, token i spelled `t{i}`: the pad token is PAD_ID's
    (`t0`), the eos the last id's. The rows are pre-tokenized, so only its ids and specials matter."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    model = Tokenizer(models.WordLevel(vocab=words, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token=f"t{PAD_ID}", eos_token=f"t{vocab - 1}",
                                   unk_token="t1")


def rows(micro_batch: MicroBatch, ignore_index: int = -100) -> list[dict[str, list[int]]]:
    """The micro-batch as pre-tokenized prompt-completion examples: each sequence without its pads,
    `completion_mask` 1 where the engine's target carries loss."""
    ids, mask, target = micro_batch.inputs["input_ids"], micro_batch.inputs["attention_mask"], micro_batch.target
    out = []
    for r in range(ids.shape[0]):
        length = int(mask[r].sum())
        out.append({"input_ids": ids[r, :length].tolist(),
                    "completion_mask": (target[r, :length] != ignore_index).long().tolist()})
    return out


class SFTFlavour:
    """The SFTTrainer in the Trainer's loop (a `TrainerFlavour`: module doc)."""

    def __init__(self, setup: SFTSetup):
        self.setup = setup

    def base(self) -> type:
        from trl import SFTTrainer

        return SFTTrainer

    def build(self, cls: type, lm: nn.Module, arguments: dict[str, Any], optimizers: tuple, extra: dict[str, Any]) -> Any:
        from datasets import Dataset
        from trl import SFTConfig

        parallelism = arguments.get("parallelism_config")
        sp = parallelism.sp_size if parallelism is not None else 1
        # SFTConfig's bf16 defaults to True (autocast); the run's dtype is the model's, as with
        # the Trainer's own arguments (bf16 only where the SP path asks DeepSpeed for it)
        config = SFTConfig(**{"bf16": False, **arguments}, completion_only_loss=self.setup.completion_only_loss, packing=False,
                           pad_to_multiple_of=sp if sp > 1 else None, dataset_num_proc=None)
        vocab = int(lm.config.vocab_size)  # type: ignore[union-attr, arg-type]  # an HF PreTrainedModel
        return cls(model=lm, args=config, train_dataset=Dataset.from_list([PLACEHOLDER]),
                   processing_class=tokenizer(vocab), optimizers=optimizers, **extra)

    def batches(self, trainer: Any, micro_batches: Sequence[MicroBatch], sp: int) -> list[dict[str, Any]]:
        from datasets import Dataset

        # one preparation per step (its maps are per row, its filter keeps the order), cut back
        # into the micro-batches after
        per_batch = [rows(micro_batch) for micro_batch in micro_batches]
        examples = [e for batch in per_batch for e in batch]
        prepared = trainer._prepare_dataset(Dataset.from_list(examples), trainer.processing_class, trainer.args,
                                            False, None, "train")
        # the preparation drops the rows with no completion token (its last filter); the engine's
        # masks make such rows on purpose (an empty micro-batch, a rank without tokens), so each
        # comes back as the fully masked row it was: it carries no loss and changes no other
        # row's logits, and every rank keeps its K micro-steps
        kept, i, made = prepared.to_list(), 0, []
        for e in examples:
            if i < len(kept) and kept[i]["input_ids"] == e["input_ids"]:
                made.append(kept[i])
                i += 1
            else:
                made.append({"input_ids": e["input_ids"], "labels": [IGNORE_INDEX] * len(e["input_ids"])})
        assert i == len(kept), "the preparation only drops rows (max_length truncates none of the engine's)"
        out, start = [], 0
        for batch in per_batch:
            out.append(trainer.data_collator(made[start:start + len(batch)]))
            start += len(batch)
        return out


def _setup() -> None:
    """Per process where no fork server preloaded them (a GPU pool's ranks, or a pool the plain
    Trainer's case started first: the two share 'hf-trainer' pools): the Trainer and TRL."""
    import transformers.trainer  # noqa: F401
    import trl  # noqa: F401


def sft_trainer_case(name: str, setup: SFTSetup = SFTSetup(), **case_fields: Any) -> Case:
    """A `Case` checking TRL's SFTTrainer's own training step (`setup`'s model and user code) over
    the run's ranks (DP, or DP x SP through accelerate's ParallelismConfig over DeepSpeed's
    Ulysses) against the same HF model in float64 on one device, under the training-step check.
    `case_fields`: any other `Case` field."""
    tags = ("trl", *case_fields.pop("tags", ()))
    base = hf_trainer_case(name, setup.hf(), flavour=SFTFlavour(setup), tags=tags, **case_fields)

    def validate(cfg) -> None:
        releases.require("sp_harness.cases.frameworks.trl.compat", name)
        base.validate(cfg)

    installed = {d: releases.installed_release(d) or "(not installed)" for d in ("trl", "transformers")}
    return dataclasses.replace(base, validate=validate, setup=_setup, preload=(*base.preload, "trl"),
                               description=f"TRL {installed['trl']} SFTTrainer's own training step ({setup.model}, "
                                           f"transformers {installed['transformers']}'s loop)")


__all__ = ["PLACEHOLDER", "TRL_VERSION", "SFTFlavour", "SFTSetup", "rows", "sft_trainer_case", "tokenizer"]
