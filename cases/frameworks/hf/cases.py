"""Stage: config and step. The transformers Trainer's built-in cases (registered where
transformers and accelerate are installed): its own training step on a tiny Llama and a tiny
Qwen2, with a user's `compute_loss` override, and the gradient-accumulation bugs the Trainer has
shipped, reintroduced through a Trainer subclass as a user (or an upstream release) wrote them;
and the release cases, the same correct cases whose expected verdict follows the installed
release: FAIL where it shipped one of those bugs (`SHIPPED`), PASS where it is fixed."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_harness.cases.frameworks.hf.case import HFTrainerSetup, hf_trainer_case, hf_trainer_shard

# ShownWith and shown_with moved to releases (DeepSpeed's release cases show bugs together too)
from sp_harness.cases.frameworks.releases import ShippedBug, ShownWith, release_case, shown_with  # noqa: F401
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


def sp_labels(inputs: dict) -> torch.Tensor:
    """The labels an SP rank's loss reads, popped from `inputs`: the adapter's `shift_labels` (its
    shard of labels[..., 1:], -100 padded); where there is no SP (one rank, or SP 1: the Trainer's
    DDP path, which the degree-invariance check compares the SP run with) the whole sequence's
    labels shifted the same way, so the same user code runs on both paths."""
    labels = inputs.pop("labels", None)
    if "shift_labels" in inputs:
        return inputs.pop("shift_labels")
    assert labels is not None, "the Trainer's DDP path hands the collator's labels"
    return F.pad(labels[..., 1:], (0, 1), value=-100)


def sp_group_sum(trainer, local: torch.Tensor) -> torch.Tensor:
    """`local`'s sum over the rank's SP group (the value the ranks log), detached; itself at SP 1."""
    total = local.detach().clone()
    if trainer.get_sp_size() > 1:
        from deepspeed.utils import groups

        dist.all_reduce(total, group=groups._get_sequence_parallel_group())
    return total


class SPTokenMean:
    """A user's Trainer code for accelerate's sequence parallelism (DeepSpeed Ulysses), done right:
    the token mean over every valid token of the K micro-batches of every rank, as the Trainer
    means without SP (`average_tokens_across_devices`). The adapter hands each rank its shard's
    `shift_labels`, and the Trainer counts no tokens under SP (its count looks for `labels`, which
    the adapter removed), so the count is taken here: every rank's valid shift_labels over the K
    micro-steps, gathered (the SP shards of one sequence are disjoint: each token is counted once).
    Each rank backpropagates its own shard's token-loss sum over that count, x DP (DeepSpeed's
    engine averages the grads over DP and sums them over SP); the value it returns for the log is
    the SP group's sum, so the ranks' logged losses average to the token mean. At SP 1 (no
    adapter) the same code is the DDP token mean (`sp_labels`)."""

    loss_is_scaled_for_ga = True

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        local = torch.stack([(sp_labels(dict(b)) != -100).sum() for b in batches]).sum().to(device)  # b stays whole
        return batches, self.accelerator.gather(local).sum()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = sp_labels(inputs)
        outputs = model(**inputs)
        local = F.cross_entropy(outputs.logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                reduction="sum")
        group_sum = sp_group_sum(self, local)
        dp = self.args.world_size // self.get_sp_size()
        loss = (local + (group_sum - local).detach()) * dp / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


class SPCountDividedBySP(SPTokenMean):
    """The token count divided by the non-data-parallel size (TP x CP x SP), as the Trainer's own
    count does, where Ulysses has already sharded the sequence: loss and grads x sp_size."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        return batches, count / self.get_sp_size()


class SPDuplicateData(SPTokenMean):
    """Every SP rank hands the adapter the same batch: each round's SP micro-steps are all the
    first SP rank's sequences (what the adapter yields when the SP ranks' dataloaders are not
    sharded over the SP axis), so the others' are never trained on and that one is trained SP times."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        sp = self.get_sp_size()
        return [batches[i - i % sp] for i in range(len(batches))], count


class SPAccumulationCountTimesSP(SPTokenMean):
    """The accumulation count taken from the SP adapter's length, which is the dataloader's x SP
    (`UlyssesSPDataLoaderAdapter.__len__`; the Trainer multiplies `len_dataloader` by sp_size):
    each micro-step's loss divided by SP once more, loss and grads 1 / sp_size of the token mean."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss / self.get_sp_size()
        return (loss, outputs) if return_outputs else loss


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


STAGE = "reported loss"
"""Where the check catches each of them first on their release cases' config: the reported loss
(the training-step check's first stage). The grads fail too."""

MEAN_OF_MEANS_BUG = ShippedBug(
    distribution="transformers", first="4.45.0", fixed="4.46.0", stage=STAGE,
    summary="gradient accumulation as the mean of micro-batch means: the loop counts no tokens, each micro-batch's "
            "loss is its own token mean, divided by K and averaged over the DDP ranks",
    source="https://github.com/huggingface/transformers/pull/34191")
DOUBLED_LOSS_BUG = ShippedBug(
    distribution="transformers", first="4.47.0", fixed="4.47.1", stage=STAGE,
    summary="training_step calls compute_loss without num_items_in_batch where the model accepts loss kwargs: each "
            "micro-batch's own token mean, times the ranks, never divided by K (loss and grads ~K x W x the mean)",
    source="https://github.com/huggingface/transformers/pull/35207")
LABEL_SMOOTHER_BUG = ShippedBug(
    distribution="transformers", first="4.46.0", fixed="5.15.0", stage=STAGE,
    summary="compute_loss calls the LabelSmoother without num_items_in_batch: with label_smoothing_factor > 0 each "
            "micro-batch's smoothed loss is its own token mean, which the Trainer no longer divides by K",
    source="https://github.com/huggingface/transformers/issues/46731")
GRADS_DIVIDED_TWICE_BUG = ShippedBug(
    distribution="transformers", first="5.2.0", fixed="5.5.4", stage="grads before clipping",
    summary="gradient accumulation divides the grads by K twice: the Trainer hands accelerate "
            "GradientAccumulationPlugin(num_steps=K), so accelerate's backward divides a loss already normalised over "
            "the K micro-batches' tokens by K again (DDP; DeepSpeed is exempt). The reported loss is right, every grad "
            "is 1/K of it",
    source="transformers 5.2.0 to 5.5.3 trainer.py create_accelerator_and_postprocess (grad_acc_kwargs['num_steps'] = "
           "gradient_accumulation_steps); 5.5.4 sets it to 1, 'to avoid any double-division'; found by this release "
           "matrix on 5.3.0")
"""Bisected from the wheels: 5.0.0 and 5.1.0 leave num_steps unset (accelerate's 1), 5.2.0 to 5.5.3 set
it to K, 5.5.4 on set it to 1; measured on 5.3.0 (grads 0.333x at K = 3, loss right)."""
SHIPPED = (MEAN_OF_MEANS_BUG, DOUBLED_LOSS_BUG, LABEL_SMOOTHER_BUG, GRADS_DIVIDED_TWICE_BUG)
"""The Trainer's shipped accumulation bugs the release cases catch, oldest first."""

_DP2_K3 = (("world_size", 2), ("dp", 2), ("train_step", True), ("micro_batches", 3), ("optimizer", "sgd"),
           ("clip_grad_norm", 0.01), ("dtype", "float32"))
"""DP 2, K = 3 (the engine's micro-batches hold different token counts, the last none), SGD with
clipping active: every one of these bugs moves the reported loss (and the grads) by a multiple of
its bound."""

SHOWN_34191 = shown_with(MEAN_OF_MEANS_BUG, DOUBLED_LOSS_BUG, GRADS_DIVIDED_TWICE_BUG)
SHOWN_35207 = shown_with(DOUBLED_LOSS_BUG, MEAN_OF_MEANS_BUG, GRADS_DIVIDED_TWICE_BUG)
SHOWN_GRADS_DIVIDED_TWICE = shown_with(GRADS_DIVIDED_TWICE_BUG, MEAN_OF_MEANS_BUG, DOUBLED_LOSS_BUG)
SHOWN_46731 = shown_with(LABEL_SMOOTHER_BUG, MEAN_OF_MEANS_BUG, DOUBLED_LOSS_BUG, GRADS_DIVIDED_TWICE_BUG)
"""Each release case's bug with the others its config shows (`_DP2_K3` shows every one of them but
the label smoother's, which needs `HF_TRAINER_SMOOTHING`'s smoothing)."""

RELEASE_34191 = release_case(
    HF_TRAINER_LLAMA, name="release-hf-34191-mean-of-micro-batch-means", fields=_DP2_K3,
    bug=SHOWN_34191,
    note="transformers 4.45.x: the mean of micro-batch means (3.609 reported against a token mean of 5.402); "
         "4.46.0 on: the token mean over every micro-batch of every rank; 4.47.0 FAILs it too, through #35207, and "
         "5.2.0 to 5.5.3 at the grads, through the grads divided by K twice")
RELEASE_35207 = release_case(
    HF_TRAINER_LLAMA, name="release-hf-35207-loss-times-k-and-ranks", fields=_DP2_K3,
    bug=SHOWN_35207,
    note="transformers 4.47.0: 21.65 reported against a token mean of 5.40 (each micro-batch's mean x W, summed, the "
         "empty one's NaN filtered as the running sum again); 4.47.1: fixed; 4.45.x FAILs it too, through #34191, and "
         "5.2.0 to 5.5.3 at the grads, through the grads divided by K twice")
RELEASE_GRADS_DIVIDED_TWICE = release_case(
    HF_TRAINER_LLAMA, name="release-hf-5x-grads-divided-by-k-twice", fields=_DP2_K3,
    bug=SHOWN_GRADS_DIVIDED_TWICE,
    note="transformers 5.2.0 to 5.5.3: every grad 1/K (0.333x at K = 3) with the reported loss right; 5.5.4 on: "
         "fixed. On those releases the two release cases above FAIL at the grads through it too; 4.45.x and 4.47.0 "
         "FAIL this one at the reported loss, through #34191 and #35207")
RELEASE_46731 = release_case(
    HF_TRAINER_SMOOTHING, name="release-hf-46731-label-smoother-per-micro-batch", fields=_DP2_K3,
    bug=SHOWN_46731,
    note="transformers 4.46.0 to 5.14.x: each micro-batch's smoothed token mean, not divided by K; 5.15.0: over "
         "num_items_in_batch; 4.45.x FAILs it too, through #34191")


# ---------------------------------------------------------------------------------------------
# Sequence parallelism: the Trainer over accelerate's ParallelismConfig(sp_size=, sp_backend=
# "deepspeed") (sp_harness.cases.frameworks.hf.sp), DP 2 x SP 2
# ---------------------------------------------------------------------------------------------

_SP = (("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 2))
SP_EXAMPLES = (Example(fields=(*_SP, ("optimizer", "adamw"), ("dtype", "float32")),
                       note="DP 2 x SP 2 (DeepSpeed Ulysses, ZeRO-1), K=2, the Trainer's own AdamW, float32"),
               Example(fields=(*_SP, ("optimizer", "adamw"), ("dtype", "bfloat16")),
                       note="DP 2 x SP 2, K=2, AdamW, bfloat16 (DeepSpeed's bf16 with fp32 masters)"),
               Example(fields=(*_SP, ("optimizer", "sgd"), ("clip_grad_norm", 0.01), ("dtype", "float32")),
                       note="DP 2 x SP 2, K=2, SGD with DeepSpeed's clipping active"))

HF_TRAINER_SP = register(hf_trainer_case("hf-trainer-sp-llama", HFTrainerSetup(trainer_class=SPTokenMean),
                                         isolation=ISOLATION, examples=SP_EXAMPLES))
"""The Trainer's own SP step with a user's token-mean loss (`SPTokenMean`)."""


mutant(HF_TRAINER_SP, name="mutant-hf-trainer-sp-count-divided-by-sp",
       summary="the token count divided by sp_size although Ulysses already sharded the sequence",
       bug="num_items_in_batch divided by the non-data-parallel size (TP x CP x SP) where each SP rank holds only "
           "its own shard's tokens: every rank's loss and grads x sp_size",
       source="huggingface/transformers#46775 (fixed by PR #46855)",
       shard=hf_trainer_shard(HFTrainerSetup(trainer_class=SPCountDividedBySP)), train_loss=HF_TRAINER_SP.train_loss, tags=("train-step",),
       killed_by=("reported loss", "train-step-sp"))

mutant(HF_TRAINER_SP, name="mutant-hf-trainer-sp-duplicate-data",
       summary="the SP ranks hand the adapter the same batch: one sequence trained SP times, the others never",
       bug="the SP data-loader adapter yields the first SP rank's batch on every micro-step of a round (the SP ranks' "
           "dataloaders not sharded over the SP axis): the accumulated grads are of the wrong sequences",
       source="deepspeedai/DeepSpeed#7484 (UlyssesSPDataLoaderAdapter returning duplicate data)",
       shard=hf_trainer_shard(HFTrainerSetup(trainer_class=SPDuplicateData)), train_loss=HF_TRAINER_SP.train_loss, tags=("train-step",),
       killed_by=("reported loss", "train-step-sp"))

mutant(HF_TRAINER_SP, name="mutant-hf-trainer-sp-accumulation-count-times-sp",
       summary="the accumulation count taken from the SP adapter's length (the dataloader's x sp_size)",
       bug="each micro-step's loss divided by K x sp_size, where the K micro-steps are the adapter's (its __len__ "
           "is len(dataloader) x sp_size): loss and grads 1 / sp_size of the token mean",
       source="verl's SFT trainer counting accumulation steps differently under SP; the adapter's length: "
              "deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPDataLoaderAdapter.__len__ (0.19.8)",
       shard=hf_trainer_shard(HFTrainerSetup(trainer_class=SPAccumulationCountTimesSP)), train_loss=HF_TRAINER_SP.train_loss, tags=("train-step",),
       killed_by=("reported loss", "train-step-sp"))

SP_LOSS_BUG = ShippedBug(
    distribution="transformers", first="5.3.0", fixed=None, stage=STAGE,
    summary="under accelerate's SP (sp_backend 'deepspeed') the Trainer's own loss is each micro-step's SP-group "
            "token mean, divided by K and averaged over DP (the mean of micro-batch means, #34191's objective), and "
            "its grads are sp_size x that loss's (every SP rank backpropagates the whole group's loss, DeepSpeed "
            "sums the SP ranks' grads): 0.25x the reported loss, 0.5x the grads at DP 2 x SP 2, K=2",
    source="transformers 5.23.0 integrations/deepspeed.py deepspeed_sp_compute_loss and trainer.py "
           "(model_accepts_loss_kwargs = False under SP); the accumulation weighting raised in the review of PR #41832")
"""`first` is the oldest release this integration runs the SP path on (the 5.3 loop); `fixed` None:
no fix is released (the release matrix re-checks when one ships)."""

RELEASE_SP_LOSS = release_case(
    HF_TRAINER_LLAMA, name="release-hf-sp-mean-of-means-times-sp", bug=SP_LOSS_BUG,
    fields=(*_SP, ("optimizer", "adamw"), ("dtype", "float32")),
    note="the Trainer's own loss under accelerate's SP at DP 2 x SP 2, K=2: 1.339 reported against a token mean of "
         "5.356, the grads 0.500x")
