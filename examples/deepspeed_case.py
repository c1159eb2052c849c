"""DeepSpeed 0.19.8 Ulysses (its DistributedAttention around your own local attention), checked by
sp-harness (pip install -e ".[deepspeed]"):

    sp-harness check --case examples/deepspeed_case.py:DS_ULYSSES --world-size 2
    sp-harness check --case examples/deepspeed_case.py:DS_ULYSSES --world-size 4 --dtype bfloat16
    sp-harness check --case examples/deepspeed_case.py:DS_ULYSSES_F64 --world-size 2 --dtype float64
    sp-harness check --case examples/deepspeed_case.py:DETACHED --world-size 2         # FAILs at grad
    sp-harness check --case examples/deepspeed_case.py:HF_LLAMA --world-size 2
"""

import torch.nn.functional as F

from sp_harness import mutant
from sp_harness.cases.frameworks.deepspeed import detached, hf_ulysses_case, ulysses_case


def my_attention(q, k, v, *, causal):  # (B, S, heads, d) -> (B, S, heads, d), my heads only
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


DS_ULYSSES = ulysses_case("my-ds-ulysses", local_attention=my_attention)  # DeepSpeed's engine syncs grads
DS_ULYSSES_F64 = ulysses_case("my-ds-ulysses-f64", local_attention=my_attention, grad_sync="all-reduce")
# the all-to-all's output cut from the graph (deepspeedai/DeepSpeed#8491): no grad reaches q/k/v
DETACHED = mutant(DS_ULYSSES, name="mutant-my-ds-detached", summary="q/k/v detached after the all-to-all",
                  bug="no grad flows back through DeepSpeed's all-to-all", source="deepspeedai/DeepSpeed#8491",
                  shard=ulysses_case("x", local_attention=detached(my_attention)).shard)
# DeepSpeed's UlyssesSPAttentionHF (Arctic long-sequence training) on a tiny HF Llama (needs transformers)
HF_LLAMA = hf_ulysses_case("my-ds-ulysses-hf-llama", dict(num_key_value_heads=2))
