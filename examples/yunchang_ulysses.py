"""Your own model with yunchang 0.6.4's UlyssesAttention, checked by sp-harness against the same
model with exact attention on one device (pip install sp-harness[yunchang]):

    sp-harness check --case examples/yunchang_ulysses.py:ULYSSES --world-size 2 --dtype float32
    sp-harness check --case examples/yunchang_ulysses.py:ULYSSES --world-size 4 --dtype bfloat16

Where your training code builds `UlyssesAttention(sp_group)`, the factory calls `attention()`;
the harness gives it exact attention in the reference and yunchang's layer in the sharded twin.
The model takes the case's batch: `tokens` and their global `positions`, (batch, seq) each.
"""

from torch import nn

from sp_harness.cases.frameworks.yunchang import ulysses_case


class Block(nn.Module):
    def __init__(self, hidden, heads, attention):
        super().__init__()
        self.heads, self.qkv, self.out, self.attn = heads, nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden), attention()
        self.norm, self.mlp = nn.RMSNorm(hidden), nn.Sequential(nn.Linear(hidden, 64), nn.GELU(), nn.Linear(64, hidden))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        x = x + self.out(self.attn(q, k, v, causal=True).reshape(b, s, h))  # (batch, seq, heads, head_dim) core
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, cfg, attention):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(cfg.vocab, cfg.hidden), nn.Embedding(cfg.seq_len, cfg.hidden), nn.Linear(cfg.hidden, cfg.vocab)
        self.blocks = nn.Sequential(*(Block(cfg.hidden, cfg.num_heads, attention) for _ in range(cfg.num_layers)))

    def forward(self, tokens, positions):
        return self.head(self.blocks(self.tok(tokens) + self.pos(positions)))


ULYSSES = ulysses_case("my-ulysses-lm", model=TinyLM)
