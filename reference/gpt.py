"""A small GPT, nanoGPT style: the single-device reference for every GPT case.

Stage: step. Token embedding + learned positions, pre-norm blocks (LayerNorm or
RMSNorm, both with affine weights), causal multi-head attention, GELU MLP, final norm, LM head.
Everything is deterministic given the seed, and dropout is off so a sharded twin can match it
to machine precision. Parameter names here are the names every sharded case maps back to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    vocab: int = 64
    """Vocabulary size (tokens are 0..vocab-1)."""
    max_seq_len: int = 64
    """Length of the learned position table; inputs may be shorter."""
    hidden: int = 32
    """Model width h."""
    num_heads: int = 4
    """Attention heads a; hidden must be a multiple of num_heads."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: num_heads. Must divide num_heads."""
    causal: bool = True
    """Causal (decoder) attention, or full bidirectional attention."""
    ffn: int = 64
    """MLP inner width."""
    num_layers: int = 2
    """Transformer blocks."""
    norm: str = "layernorm"
    """'layernorm' or 'rmsnorm' (both with affine weights)."""
    eps: float = 1e-5
    """Norm epsilon."""

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"num_heads({self.num_heads}) does not divide hidden({self.hidden})")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads({self.num_kv_heads}) does not divide num_heads({self.num_heads})")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.hidden, eps=cfg.eps)
    return RMSNorm(cfg.hidden, cfg.eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, return_lse: bool = False):
    """Softmax attention of (B, a, S, d) queries over (B, a_kv, S, d) keys/values, a_kv dividing a
    (grouped-query: each k/v head serves a / a_kv consecutive query heads) -> (B, a, S, d); with
    `return_lse`, also each query's log-sum-exp of its scores, (B, a, S) (no grad: a statistic)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, a, S, d)
    s_q, s_k = q.shape[2], k.shape[2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, a, S, S)
    if causal:
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
    out = att.softmax(dim=-1) @ v  # (B, a, S, d)
    return (out, att.detach().logsumexp(dim=-1)) if return_lse else out  # lse: (B, a, S)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        self.head_dim = cfg.hidden // cfg.num_heads
        self.causal = cfg.causal
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.k_proj = nn.Linear(cfg.hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(cfg.hidden, self.num_kv_heads * self.head_dim)
        self.out_proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, S, H)
        # -1 instead of num_heads so a tensor-parallel subclass can reuse this with local heads
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, a, S, d)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, a_kv, S, d)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, a_kv, S, d)
        # the log-sum-exps are kept for the harness: an SP attention that exposes its own is judged on them
        y, self.lse = attention(q, k, v, causal=self.causal, return_lse=True)  # (B, a, S, d), (B, a, S)
        y = y.transpose(1, 2).reshape(b, s, -1)  # (B, S, a*d)
        return self.out_proj(y)  # (B, S, H)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, S, H)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))  # (B, S, H)
        return x + self.mlp(self.norm2(x))  # (B, S, H)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s = tokens.shape  # (B, S) int64
        # positions as an input: a sequence-sharded twin embeds its tokens' global positions
        pos = torch.arange(s, device=tokens.device) if positions is None else positions  # (S,) or (B, S)
        x = self.tok_emb(tokens) + self.pos_emb(pos)  # (B, S, H)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))  # (B, S, V)


def init_gpt_(model: GPT, seed: int) -> GPT:
    """Deterministic init from a seed, independent of the global RNG state.

    Norm weights and biases get random values near (1, 0) rather than exactly (1, 0): a sharded
    twin whose norm weights never move would otherwise look right by accident.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                # 1/sqrt(fan_in) keeps activations O(1); biases non-zero so bias bugs show
                std = 1.0 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.1
                p.copy_(std * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def build_gpt(cfg: GPTConfig, seed: int, dtype: torch.dtype = torch.float64) -> GPT:
    return init_gpt_(GPT(cfg).to(dtype), seed)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over every position: (..., V), (...) -> scalar."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    return F.cross_entropy(flat, targets.reshape(-1), reduction="sum")
