"""Stage: config and step. The transformers Trainer's built-in cases (registered where
transformers and accelerate are installed): its own training step on a tiny Llama and a tiny
Qwen2, with a user's `compute_loss` override, and the gradient-accumulation bugs the Trainer has
shipped, reintroduced through a Trainer subclass as a user (or an upstream release) wrote them."""

from __future__ import annotations

import torch.nn.functional as F

from sp_harness.cases.frameworks.hf.case import HFTrainerSetup, hf_trainer_case, hf_trainer_shard
from sp_harness.config.case import Example
from sp_harness.config.registry import mutant, register

ISOLATION = "hf-trainer"
"""accelerate's PartialState / AcceleratorState are process-wide singletons: the Trainer's cases
share processes only with each other."""


class TokenSumLoss:
    """A user's compute_loss override, done right: the shifted token-loss sum over the Trainer's
    `num_items_in_batch` (every valid label of the K micro-batches on every rank), times the DP
    world because DDP averages the grads (what the Trainer's own compute_loss does under
    `average_tokens_across_devices`)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
        loss = loss / num_items_in_batch * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss


class MeanOfMicroBatchMeans:
    """compute_loss that ignores `num_items_in_batch` (the model's own per-micro-batch mean) and
    says so (`loss_is_scaled_for_ga = False`): the Trainer divides by GA, which is the loss of
    transformers before 4.46 (huggingface/transformers#34191): a mean of micro-batch means."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class Release4470TrainingStep:
    """`Trainer.training_step` as transformers 4.47.0 shipped it (trainer.py 4.47.0 lines 3651-3655
    and 3681-3692): a model that accepts loss kwargs is called WITHOUT `num_items_in_batch` (its
    own per-micro-batch mean), the loss is not divided by GA before backward, and only the
    reported loss is normalised, after backward, where `num_items_in_batch is None`. Fixed by
    huggingface/transformers#35207 (4.47.1)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            if self.model_accepts_loss_kwargs:
                loss = self.compute_loss(model, inputs)
            else:
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        kwargs = {}
        if self.args.n_gpu > 1:
            loss = loss.mean()
        self.accelerator.backward(loss, **kwargs)
        if num_items_in_batch is None:
            return loss.detach() / self.args.gradient_accumulation_steps
        return loss.detach()


class LabelSmootherPerMicroBatch:
    """`compute_loss` with the Trainer's `LabelSmoother` called without `num_items_in_batch`, as
    transformers called it before PR #47261: each micro-batch's smoothed loss is its own token mean
    while the Trainer (the model accepts loss kwargs) no longer divides by the accumulation steps."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        smoother = self.label_smoother
        self.label_smoother = lambda outputs, labels, shift_labels=False, num_items_in_batch=None: smoother(
            outputs, labels, shift_labels=shift_labels)
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.label_smoother = smoother


def _examples(*more):
    return (Example(fields=(("world_size", 2), ("dp", 2), ("train_step", True), ("micro_batches", 3),
                            ("optimizer", "sgd"), ("clip_grad_norm", 0.01)),
                    note="DP 2, K=3, SGD with clipping active, float32"),
            Example(fields=(("world_size", 4), ("dp", 4), ("train_step", True), ("micro_batches", 3),
                            ("optimizer", "adamw"), ("dtype", "bfloat16")),
                    note="DP 4, K=3, the Trainer's own AdamW, bfloat16"), *more)


HF_TRAINER_LLAMA = register(hf_trainer_case("hf-trainer-llama", isolation=ISOLATION, examples=_examples()))
HF_TRAINER_QWEN2 = register(hf_trainer_case("hf-trainer-qwen2", HFTrainerSetup(model="qwen2"), isolation=ISOLATION,
                                            examples=_examples()))
HF_TRAINER_USER_LOSS = register(hf_trainer_case("hf-trainer-llama-user-loss", HFTrainerSetup(trainer_class=TokenSumLoss),
                                                isolation=ISOLATION, examples=_examples()))
"""A user's compute_loss override (token sum over num_items_in_batch, x the DP world)."""

MEAN_OF_MEANS = mutant(HF_TRAINER_LLAMA, name="mutant-hf-trainer-mean-of-micro-batch-means",
       summary="compute_loss ignores num_items_in_batch (the model's per-micro-batch mean), the Trainer divides by GA",
       bug="each micro-batch normalised by its own valid tokens and the K means averaged (and each rank's mean "
           "averaged over DDP): a micro-batch of few tokens weighs as much as a full one, an empty one is NaN",
       source="huggingface/transformers gradient accumulation before 4.46, fixed in PR #34191; the same loss from "
              "any compute_loss override that drops num_items_in_batch",
       shard=hf_trainer_shard(HFTrainerSetup(trainer_class=MeanOfMicroBatchMeans)), train_loss=HF_TRAINER_LLAMA.train_loss,
       tags=("train-step",), killed_by=("reported loss", "train-step-dp"))

TRAINING_STEP_4470 = mutant(HF_TRAINER_LLAMA, name="mutant-hf-trainer-4470-training-step",
       summary="Trainer.training_step as shipped in transformers 4.47.0",
       bug="the model's per-micro-batch mean (num_items_in_batch not passed to a model that accepts it), never "
           "divided by GA, times the world size: the loss and grads come out about K x W x the token mean",
       source="huggingface/transformers v4.47.0 trainer.py 3651-3692; fixed in PR #35207 (4.47.1)",
       shard=hf_trainer_shard(HFTrainerSetup(trainer_class=Release4470TrainingStep)),
       train_loss=HF_TRAINER_LLAMA.train_loss, tags=("train-step",), killed_by=("reported loss", "train-step-dp"))

HF_TRAINER_SMOOTHING = register(hf_trainer_case("hf-trainer-llama-label-smoothing", HFTrainerSetup(label_smoothing=0.1),
                                                isolation=ISOLATION, examples=_examples()))
"""The Trainer's own label smoothing (`label_smoothing_factor` 0.1: its LabelSmoother over
num_items_in_batch), the reference smoothing the same."""

SMOOTHER_PER_MICRO_BATCH = mutant(HF_TRAINER_SMOOTHING, name="mutant-hf-trainer-label-smoother-per-micro-batch",
       summary="the Trainer's LabelSmoother normalises each micro-batch by its own tokens (num_items_in_batch dropped)",
       bug="with label_smoothing_factor > 0 and K micro-batches each micro-batch's smoothed loss is its own token "
           "mean, which the Trainer no longer divides by K (the model accepts loss kwargs): loss and grads a "
           "multiple of the token mean (4.0x at DP 2, K = 3 here; #46731: ~gradient_accumulation_steps)",
       source="huggingface/transformers#46731 (LabelSmoother ignores num_items_in_batch), fixed by PR #47261",
       shard=hf_trainer_shard(HFTrainerSetup(label_smoothing=0.1, trainer_class=LabelSmootherPerMicroBatch)),
       train_loss=HF_TRAINER_SMOOTHING.train_loss, tags=("train-step",), killed_by=("reported loss", "train-step-dp"))
