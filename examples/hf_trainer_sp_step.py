"""The HF Trainer with accelerate's sequence parallelism (DeepSpeed Ulysses) and a token-mean loss."""
import torch
import torch.nn.functional as F

from sp_harness.cases.frameworks.hf import HFTrainerSetup, hf_trainer_case


class SPTokenMean:  # the token mean over every micro-step of every rank (the Trainer counts none under SP)
    loss_is_scaled_for_ga = True

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        local = torch.stack([(b["shift_labels"] != -100).sum() for b in batches]).sum().to(device)
        return batches, self.accelerator.gather(local).sum()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from deepspeed.utils import groups  # imported on the ranks only

        labels, _ = inputs.pop("shift_labels"), inputs.pop("labels", None)
        outputs = model(**inputs)
        local = F.cross_entropy(outputs.logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        logged = local.detach().clone()  # what the log shows: the SP group's sum
        torch.distributed.all_reduce(logged, group=groups._get_sequence_parallel_group())
        dp = self.args.world_size // self.get_sp_size()  # DeepSpeed averages the grads over DP, sums over SP
        loss = (local + (logged - local).detach()) * dp / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


SP = hf_trainer_case("my-hf-sp", HFTrainerSetup(trainer_class=SPTokenMean))
