"""Stage: config and step. TRL's SFTTrainer's built-in cases (registered where trl, transformers
and accelerate are installed; the SP ones need DeepSpeed too): its own step under DDP, its step
under accelerate's SP with a user's token-mean fix over TRL's fused LM head, the SP bugs as that
user's code could carry them, and the release case of what the SFTTrainer does under SP as shipped
(the Trainer's SP loss). Of the Trainer's SP mutants, the count divided by SP (#46775) is run
here too, through TRL's Trainer; duplicate SP data and the accumulation count x SP are the
Trainer's SP path's own, unchanged by TRL (sp_harness.cases.frameworks.hf.cases)."""

from __future__ import annotations

from sp_harness.cases.frameworks.hf.cases import (
    SP_EXAMPLES,
    SP_LOSS_BUG,
    SPCountDividedBySP,
    SPTokenMean,
    sp_group_sum,
    sp_labels,
)
from sp_harness.cases.frameworks.releases import release_case
from sp_harness.cases.frameworks.trl.case import SFTSetup, sft_trainer_case
from sp_harness.config.case import Example
from sp_harness.config.registry import mutant, register

ISOLATION = "hf-trainer"
"""accelerate's process-wide state: TRL's cases share rank processes with the Trainer's only."""


class SFTSPTokenMean(SPTokenMean):
    """A user's SFTTrainer code for accelerate's SP, done right (the Trainer's `SPTokenMean`: the
    token mean over every valid token of the K micro-batches of every rank), its token losses from
    TRL's own fused LM head (`fused_lm_head=True` with the adapter's `shift_labels`: per-token
    log-probabilities, zero where the label is -100), which the SFTTrainer's loss sums too."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = sp_labels(inputs)
        outputs = model(**inputs, shift_labels=labels, fused_lm_head=True)
        local = -outputs.log_probs.float().sum()
        group_sum = sp_group_sum(self, local)
        dp = self.args.world_size // self.get_sp_size()
        loss = (local + (group_sum - local).detach()) * dp / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


DDP_EXAMPLES = (Example(fields=(("world_size", 2), ("dp", 2), ("train_step", True), ("micro_batches", 3),
                                ("optimizer", "sgd"), ("clip_grad_norm", 0.01), ("dtype", "float32")),
                        note="DP 2, K=3 (the last micro-batch empty), SGD with clipping active, float32"),)
"""The main job's DDP example (the bf16 one runs in the exhaustive tier: tests/test_trl.py)."""

TRL_SFT = register(sft_trainer_case("trl-sft-llama", isolation=ISOLATION, examples=DDP_EXAMPLES))
"""The SFTTrainer's own step under DDP: its dataset preparation, collator, completion-only labels
and fused-LM-head loss over `num_items_in_batch`."""

TRL_SFT_SP = register(sft_trainer_case("trl-sft-sp-llama", SFTSetup(trainer_class=SFTSPTokenMean),
                                       isolation=ISOLATION, examples=SP_EXAMPLES[:2]))
"""The SFTTrainer's SP step (DP 2 x SP 2) with the user's token-mean fix over TRL's fused head; the
main job checks float32 and bfloat16 AdamW (SGD with clipping: the exhaustive tier)."""


def _sft(cls: type) -> type:
    """The Trainer's SP mutant `cls` (sp_harness.cases.frameworks.hf.cases) over the SFTTrainer fix."""
    return type(f"SFT{cls.__name__}", (cls, SFTSPTokenMean), {"__doc__": cls.__doc__})


mutant(TRL_SFT_SP, name="mutant-trl-sft-sp-count-divided-by-sp",
       summary="the token count divided by sp_size although Ulysses already sharded the sequence",
       bug="num_items_in_batch divided by the non-data-parallel size (TP x CP x SP) where each SP rank holds only "
           "its own shard's tokens: every rank's loss and grads x sp_size",
       source="huggingface/transformers#46775 (fixed by PR #46855), under TRL's SFTTrainer",
       shard=sft_trainer_case("trl-sp-count", SFTSetup(trainer_class=_sft(SPCountDividedBySP))).shard,
       train_loss=TRL_SFT_SP.train_loss, tags=("train-step",), killed_by=("reported loss", "train-step-sp"))

mutant(TRL_SFT, name="mutant-trl-sft-prompt-trained",
       summary="completion_only_loss off for a prompt-completion dataset: the prompt's tokens carry loss",
       bug="the SFTTrainer's labels built without the completion mask (completion_only_loss=False, or a dataset "
           "whose mask column is lost before preparation): the loss and grads include every prompt token",
       source="TRL's completion-only loss (SFTConfig.completion_only_loss; the masks TRL builds labels from in "
              "_prepare_dataset): the knob users set wrong, and the class of huggingface/trl's completion-mask bugs",
       shard=sft_trainer_case("trl-prompt", SFTSetup(completion_only_loss=False)).shard,
       train_loss=TRL_SFT.train_loss, tags=("train-step",), killed_by=("reported loss", "train-step-dp"))

RELEASE_SP_LOSS = release_case(
    TRL_SFT, name="release-trl-sft-sp-mean-of-means-times-sp", bug=SP_LOSS_BUG,
    fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 2), ("optimizer", "adamw"),
            ("dtype", "float32")),
    note="the SFTTrainer as shipped under accelerate's SP: it hands its fused-head loss to the Trainer's SP loss "
         "(the mean of SP-group means, grads x sp_size)")
