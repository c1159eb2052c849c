"""The Hugging Face transformers Trainer's own training step (gradient accumulation, the token
count over the micro-batches and the DP ranks, clipping, its optimizer), checked by sp-harness
against the same model in float64 on one device (pip install -e ".[hf]"):

    sp-harness check --case examples/hf_trainer_step.py:LLAMA --train-step --world-size 2 --dp 2 --micro-batches 3 --optimizer sgd --clip-grad-norm 0.01
    sp-harness check --case examples/hf_trainer_step.py:MY_LOSS --train-step --world-size 4 --dp 4 --micro-batches 3 --optimizer adamw --dtype bfloat16
    sp-harness check --case examples/hf_trainer_step.py:LOSS_FUNC --train-step --world-size 2 --dp 2 --micro-batches 3 --optimizer adamw

The Trainer's own gradient-accumulation bugs are built-in mutants (sp_harness.cases.frameworks.
hf.cases), each FAILing at the reported loss while its twin passes; on the releases that shipped
them, the release cases FAIL there too (`sp-harness releases --only release-hf`):

    sp-harness check --case mutant-hf-trainer-mean-of-micro-batch-means --train-step --world-size 2 --dp 2 --micro-batches 3 --optimizer sgd --clip-grad-norm 0.01

Any transformers of 4.45.0 to 5.23.0 runs these (docs/frameworks/hf-trainer.md, Releases): on
4.45 the Trainer has no `num_items_in_batch` and no `compute_loss_func`, so MY_LOSS and LOSS_FUNC
are UNSUPPORTED there, naming what is missing.
"""

import torch.nn.functional as F
from transformers import Trainer

from sp_harness.cases.frameworks.hf import HFTrainerSetup, hf_trainer_case


def token_sum(outputs, labels, num_items_in_batch):  # HF's shift: logits[:, t] predicts labels[:, t + 1]
    logits = outputs.logits[:, :-1].float().flatten(0, 1)
    return F.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum") / num_items_in_batch


class MyTrainer(Trainer):  # over every micro-batch's tokens on every rank; DDP averages: x the ranks
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = token_sum(outputs, labels, num_items_in_batch) * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss


LLAMA = hf_trainer_case("my-hf-llama")
MY_LOSS = hf_trainer_case("my-hf-qwen2-loss", HFTrainerSetup(model="qwen2", trainer_class=MyTrainer))
LOSS_FUNC = hf_trainer_case("my-hf-loss-func", HFTrainerSetup(compute_loss_func=token_sum))
