"""TRL's SFTTrainer with accelerate's sequence parallelism (DeepSpeed Ulysses), its token losses
from TRL's fused LM head, over the token mean of every micro-step of every rank."""
import torch

from sp_harness.cases.frameworks.hf.cases import SPTokenMean  # the token count over every SP micro-step
from sp_harness.cases.frameworks.trl import SFTSetup, sft_trainer_case


class SFTTokenMean(SPTokenMean):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from deepspeed.utils import groups  # imported on the ranks only

        labels, _ = inputs.pop("shift_labels"), inputs.pop("labels", None)
        outputs = model(**inputs, shift_labels=labels, fused_lm_head=True)  # TRL's per-token log-probs
        local = -outputs.log_probs.float().sum()
        logged = local.detach().clone()  # what the log shows: the SP group's sum
        torch.distributed.all_reduce(logged, group=groups._get_sequence_parallel_group())
        dp = self.args.world_size // self.get_sp_size()  # DeepSpeed averages the grads over DP, sums over SP
        return (local + (logged - local).detach()) * dp / num_items_in_batch


SFT_SP = sft_trainer_case("my-sft-sp", SFTSetup(trainer_class=SFTTokenMean))
