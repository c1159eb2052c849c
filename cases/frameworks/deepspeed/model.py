"""Stage: step. The models of a DeepSpeed-Ulysses case: the user's local attention in
DeepSpeed's layout (`LocalAttention`, what `DistributedAttention` wraps), the reference GPT's
attention through it on every head and the whole sequence (`UserAttention`: DistributedAttention
at SP=1, without DeepSpeed), and the sharded GPT: the reference's modules with DeepSpeed's
`DistributedAttention` in each block (`DeepSpeedUlyssesAttention`, `UlyssesGPT`), every
activation outside attention holding this rank's `seq_len / sp` tokens. A user's own model
places DistributedAttention through `SequenceParallelAttention` (`ulysses_module_case`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sp_harness.reference.gpt import GPT, Attention

LocalAttentionFn = Callable[..., torch.Tensor]
"""`fn(q, k, v, *, causal) -> out`: q (B, S, a, d), k and v (B, S, a_kv, d) with a_kv dividing
a (grouped-query), out (B, S, a, d). DeepSpeed's batch-first layout; under layout 'sbh' the
adapter hands it the same tensors transposed to batch-first."""


class LocalAttention(nn.Module):
    """What DistributedAttention wraps: the user's function in DeepSpeed's layout of the run
    ([b, s, h, d] for batch_dim_idx 0, [s, b, h, d] for 1; the function always sees batch-first)."""

    def __init__(self, fn: LocalAttentionFn, causal: bool, batch_dim_idx: int):
        super().__init__()
        self.fn, self.causal, self.batch_dim_idx = fn, causal, batch_dim_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.batch_dim_idx == 1:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = self.fn(q, k, v, causal=self.causal)
        return out.transpose(0, 1) if self.batch_dim_idx == 1 else out


class UserAttention(Attention):
    """The reference's attention (its projections, names, weights) through the user's function
    on every head and the whole sequence: DistributedAttention at SP=1, without DeepSpeed."""

    def __init__(self, ref: Attention, fn: LocalAttentionFn):
        nn.Module.__init__(self)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = ref.q_proj, ref.k_proj, ref.v_proj, ref.out_proj
        self.num_heads, self.num_kv_heads = ref.num_heads, ref.num_kv_heads
        self.head_dim, self.causal, self.fn = ref.head_dim, ref.causal, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, S, H)
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # (B, S, a, d)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # (B, S, a_kv, d)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)  # (B, S, a_kv, d)
        return self.out_proj(self.fn(q, k, v, causal=self.causal).reshape(b, s, -1))  # (B, S, H)


class DeepSpeedUlyssesAttention(nn.Module):
    """This rank's tokens -> DeepSpeed's DistributedAttention -> this rank's tokens."""

    def __init__(self, ref: UserAttention, dist_attn: nn.Module, batch_dim_idx: int, told_batch_dim_idx: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = ref.q_proj, ref.k_proj, ref.v_proj, ref.out_proj
        self.head_dim, self.batch_dim_idx, self.told = ref.head_dim, batch_dim_idx, told_batch_dim_idx
        self.dist_attn = dist_attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, s_r, H)
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # (B, s_r, a, d)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # (B, s_r, a_kv, d)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)  # (B, s_r, a_kv, d)
        if self.batch_dim_idx == 1:  # DeepSpeed's seq-first layout: (s_r, B, a, d)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        y = self.dist_attn(q, k, v, self.told)  # DeepSpeed: same layout and shape as q
        if self.batch_dim_idx == 1:
            y = y.transpose(0, 1)  # (B, s_r, a, d)
        return self.out_proj(y.reshape(b, s, -1))  # (B, s_r, H)


class UlyssesGPT(nn.Module):
    """tokens, positions (B, s_r) -> logits (B, s_r, V); the reference's modules and names."""

    def __init__(self, ref: GPT):
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks = ref.tok_emb, ref.pos_emb, ref.blocks
        self.norm_f, self.lm_head = ref.norm_f, ref.lm_head

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, s_r, H): my tokens' global positions
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))  # (B, s_r, V)




class SequenceParallelAttention(nn.Module):
    """Where a user's own model puts DeepSpeed's `DistributedAttention`: made by the `attention`
    argument of a `ulysses_module_case` factory around the user's local attention module, called
    as DistributedAttention is, `(query, key, value, batch_dim_idx, **kwargs)`.

    In the reference it calls `local_attn(query, key, value, **kwargs)` on every head and the
    whole sequence (DistributedAttention at SP 1, without DeepSpeed). On a rank, `distribute`
    hands the same local module to `DistributedAttention(local_attn, sp_group, scatter_idx,
    gather_idx, num_kv_heads=...)`, which then runs the call: all-to-all sequence -> heads, the
    local attention, all-to-all back. The local module keeps its name (`local_attn`, as in
    DistributedAttention), so a param of it has the same name on both sides."""

    dist_attn: nn.Module | None
    """DeepSpeed's DistributedAttention once `distribute` ran (a plain attribute, not a submodule)."""

    def __init__(self, local_attention: nn.Module, *, scatter_idx: int = 2, gather_idx: int = 1,
                 num_kv_heads: int | None = None):
        super().__init__()
        self.local_attn = local_attention
        self.scatter_idx, self.gather_idx, self.num_kv_heads = scatter_idx, gather_idx, num_kv_heads
        object.__setattr__(self, "dist_attn", None)  # not a submodule: local_attn's params keep one name

    def distribute(self, group) -> None:
        from sp_harness.cases.frameworks.deepspeed import compat

        object.__setattr__(self, "dist_attn", compat.distributed_attention(
            self.local_attn, group, scatter_idx=self.scatter_idx, gather_idx=self.gather_idx,
            num_kv_heads=self.num_kv_heads))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                **kwargs) -> torch.Tensor:
        if self.dist_attn is None:
            return self.local_attn(query, key, value, **kwargs)
        # no rotary_pos_emb (None, its default): 0.16.0-0.16.1's forward has no such parameter
        return self.dist_attn(query, key, value, batch_dim_idx, **kwargs)


__all__ = ["DeepSpeedUlyssesAttention", "LocalAttention", "LocalAttentionFn", "SequenceParallelAttention", "UlyssesGPT",
           "UserAttention"]
