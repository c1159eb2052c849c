"""DeepSpeed 0.19.8 Ulysses on your own module: its attention wrapped in DeepSpeed's DistributedAttention.

    sp-harness check --case examples/deepspeed_own_module.py:OWN --world-size 2                 # PASS
    sp-harness check --case examples/deepspeed_own_module.py:OWN --world-size 4 --dp 2 --dtype bfloat16
    sp-harness check --case examples/deepspeed_own_module.py:OWN_ZERO2 --world-size 4 --dp 2    # ZeRO-2
    sp-harness check --case examples/deepspeed_own_module.py:OWN_F64 --world-size 2 --dtype float64
"""

import torch.nn.functional as F
from torch import nn

from sp_harness.cases.frameworks.deepspeed import ulysses_module_case


class CoreAttention(nn.Module):  # (B, S, my heads, d): every token, this rank's heads
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)


class MyLM(nn.Module):  # my model: its attention made by `attention(...)`, called as DistributedAttention
    def __init__(self, cfg, attention):
        super().__init__()
        self.emb, self.pos = nn.Embedding(cfg.vocab, cfg.hidden), nn.Embedding(cfg.seq_len, cfg.hidden)
        self.qkv, self.out = nn.Linear(cfg.hidden, 3 * cfg.hidden), nn.Linear(cfg.hidden, cfg.vocab)
        self.attn, self.heads = attention(CoreAttention()), cfg.num_heads

    def forward(self, tokens, positions):  # my tokens and their global positions (B, S / sp)
        x = self.emb(tokens) + self.pos(positions)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)
        return self.out(x + self.attn(q, k, v, 0).flatten(2))  # batch_dim_idx 0


OWN = ulysses_module_case("my-ds-own-module", MyLM)  # DeepSpeed's engine syncs the grads
OWN_ZERO2 = ulysses_module_case("my-ds-own-module-zero2", MyLM, ds_config={"zero_optimization": {"stage": 2}})
OWN_F64 = ulysses_module_case("my-ds-own-module-f64", MyLM, grad_sync="all-reduce")  # the engine refuses float64
