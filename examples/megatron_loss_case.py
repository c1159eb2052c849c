"""Your loss and your batch on a Llama-style megatron-core 0.16.1 model, checked by sp-harness
(pip install sp-harness[megatron]):

    sp-harness check --case examples/megatron_loss_case.py:LLAMA_LOSS --world-size 2 --dtype bfloat16        # PASS
    sp-harness check --case examples/megatron_loss_case.py:LLAMA_LABELS --world-size 4 --dp 2                # PASS
    sp-harness check --case examples/megatron_loss_case.py:LLAMA_USER_LOSS --world-size 2 --dtype float64    # PASS
    sp-harness check --case examples/megatron_loss_case.py:LLAMA_MEGATRON_SMOOTHING --world-size 2           # FAIL at loss
"""

import torch
import torch.nn.functional as F

from sp_harness.cases.frameworks.megatron import megatron_case
from sp_harness.cases.frameworks.token_loss import TokenLoss

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
              gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
              sequence_parallel=True, calculate_per_token_loss=True)
GPT = dict(position_embedding_type="rope", share_embeddings_and_output_weights=True)
# a quarter of each sequence's labels out of the loss (loss_mask), 2 pad tokens under the attention mask
MASKED = TokenLoss(masked_fraction=0.25, padding=2)

# label smoothing 0.1 on the vocab-parallel logits, with the whole vocabulary's statistics (Megatron-LM #7466)
LLAMA_LOSS = megatron_case("mcore-llama-loss-tp2", CONFIG, tp=2, gpt_kwargs=GPT, smoothing="global",
                           loss=TokenLoss(label_smoothing=0.1, masked_fraction=0.25, padding=2))
# megatron's own vocab_parallel_cross_entropy(label_smoothing=0.1): its local shard's statistics (#7452 finding 1)
LLAMA_MEGATRON_SMOOTHING = megatron_case("mcore-llama-megatron-smoothing-tp2", CONFIG, tp=2, gpt_kwargs=GPT,
                                         loss=TokenLoss(label_smoothing=0.1))
# GPTModel(..., labels=) returns its per-token losses; pretrain_gpt's loss function applies loss_mask
LLAMA_LABELS = megatron_case("mcore-llama-labels-tp2", CONFIG, tp=2, gpt_kwargs=GPT, loss=MASKED, model_loss=True)


def ce_with_z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # the user's per-token loss
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    return ce + 1e-4 * torch.logsumexp(logits, dim=-1) ** 2


# on logits megatron gathers over TP (parallel_output=False)
LLAMA_USER_LOSS = megatron_case("mcore-llama-user-loss-tp2", CONFIG, tp=2, gpt_kwargs=GPT, vocab_parallel_loss=False,
                                loss=TokenLoss(loss_fn=ce_with_z_loss, masked_fraction=0.25))
