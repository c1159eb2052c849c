"""Your labels, loss mask, padding, label smoothing and loss function through DeepSpeed-Ulysses, checked by sp-harness:

    sp-harness check --case examples/deepspeed_token_loss.py:QWEN2_SFT --world-size 2                      # PASS
    sp-harness check --case examples/deepspeed_token_loss.py:QWEN2_SFT --world-size 4 --dp 2 --dtype bfloat16
    sp-harness check --case examples/deepspeed_token_loss.py:QWEN2_SFT_F64 --world-size 2 --dtype float64
    sp-harness check --case examples/deepspeed_token_loss.py:OWN_Z_LOSS --world-size 2                     # PASS

The labels are -100 on the prompt, on a quarter of each sequence and on its 2 trailing pads (causal
attention needs no mask for them: ALST takes position_ids). Each SP rank's loss is its shard's sum
over the sequence's valid tokens (the count all-reduced over the SP group); the reference computes
the same loss on the whole batch in float64.
"""

import torch.nn.functional as F
from deepspeed_own_module import MyLM  # examples/deepspeed_own_module.py: my model, DistributedAttention inside

from sp_harness.cases.frameworks.deepspeed import hf_ulysses_case, ulysses_module_case
from sp_harness.cases.frameworks.token_loss import TokenLoss

SFT = TokenLoss(label_smoothing=0.1, masked_fraction=0.25, padding=2)
QWEN2 = dict(num_key_value_heads=2)
QWEN2_SFT = hf_ulysses_case("my-ds-qwen2-sft", QWEN2, model_type="qwen2", loss=SFT)
# float64: DeepSpeed's engine reduces no float64 grad, so its sums are written out
QWEN2_SFT_F64 = hf_ulysses_case("my-ds-qwen2-sft-f64", QWEN2, model_type="qwen2", loss=SFT, grad_sync="all-reduce")


def z_loss(logits, labels):  # my per-token loss: cross entropy + 1e-2 logsumexp^2 (PaLM's z-loss)
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    return ce + 1e-2 * logits.logsumexp(-1) ** 2


OWN_Z_LOSS = ulysses_module_case("my-ds-own-z-loss", MyLM, loss=TokenLoss(loss_fn=z_loss, masked_fraction=0.25, padding=2))
