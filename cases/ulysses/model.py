"""The DeepSpeed-Ulysses twin of reference.gpt.GPT, and the swappable pieces a bug could live in.

Stage: step. Every parameter is a REPLICATED copy of the reference's (same names: the
sharded model reuses the reference's own submodules), and every activation outside attention is
sequence-sharded over the SP group (`ctx.tp_group`): rank r embeds, normalises, runs the MLP and
the LM head on its own `ctx.seq_shards[r]` tokens. Attention per block:

    q, k, v = projections of my tokens          (B, a, s_r, d), (B, a_kv, s_r, d) x 2
    all-to-all seq->heads (q, then k, then v)   (B, h_r, S, d): full sequence, my heads
    attention(q, k, v) on my heads              (B, h_r, S, d)
    all-to-all heads->seq                       (B, a, s_r, d): my tokens, every head
    out_proj                                    (B, s_r, H)

so 4 all-to-alls per layer forward and 4 in backward. Each rank's loss covers only its tokens,
so every parameter grad is a partial sum: `sync_grads` all-reduces them (SUM) over the SP group,
then averages over DP.

`Impl` gathers the pieces; a mutant (cases/ulysses/mutants.py) swaps one:

    seq_to_heads(x, heads_for, seq_sizes, group), heads_to_seq(y, heads_for, seq_sizes, A, group)
    kv_heads(q_heads, num_heads, num_kv_heads) -> heads_for of k/v
    kv_index(my_q_heads, my_kv_heads, group) -> which received k/v head each query head uses
    seq_sizes(ctx) -> the token counts the all-to-alls are sized with
    positions(positions, ctx) -> the position ids this rank embeds
    sync_grads(module, ctx)                          after backward
    local_loss(local_out, local_target, ctx) or None None: the engine's default
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sp_harness.cases.common import attention_of, sum_replicated_grads
from sp_harness.cases.ulysses import mappings
from sp_harness.config.case import Layout, Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.reference.gpt import GPT, Attention, attention


def engine_seq_sizes(ctx: RankContext) -> tuple[int, ...]:
    """The real per-rank token counts (torch.chunk's split or explicit seq_shards)."""
    return tuple(ctx.seq_shards)


def global_positions(positions: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """The engine hands each rank its slice of the global positions: use them as they are."""
    return positions


def kv_index(mine_q: tuple[int, ...], mine_kv: tuple[int, ...], group: int) -> list[int]:
    """For each of my query heads, which of the k/v heads I received it uses: query head i uses
    k/v head i // group, received as the (i // group - first)-th (kv_heads sends a range)."""
    return [i // group - (mine_kv[0] if mine_kv else 0) for i in mine_q]


def sync_grads(module: nn.Module, ctx: RankContext) -> None:
    """Every grad is a partial sum over the SP group (each rank's loss saw its tokens only):
    SUM over SP, then average over DP replicas (`sum_replicated_grads`)."""
    sum_replicated_grads(module, ctx)


@dataclass(frozen=True, kw_only=True)
class Impl:
    """Every piece of the implementation a bug could live in. `CORRECT` is the right one."""

    seq_to_heads: Callable = mappings.seq_to_heads_fn
    heads_to_seq: Callable = mappings.heads_to_seq_fn
    kv_heads: Callable = mappings.kv_heads
    kv_index: Callable = kv_index
    seq_sizes: Callable = engine_seq_sizes
    positions: Callable = global_positions
    sync_grads: Callable = sync_grads
    local_loss: Callable | None = None


CORRECT = Impl()


class UlyssesAttention(nn.Module):
    """Attention on sequence shards via two all-to-alls; the reference's projections."""

    def __init__(self, ref_attn: Attention, ctx: RankContext, impl: Impl):
        super().__init__()
        # the reference's own Linear modules: same parameter names, replicated weights
        self.q_proj, self.k_proj = ref_attn.q_proj, ref_attn.k_proj
        self.v_proj, self.out_proj = ref_attn.v_proj, ref_attn.out_proj
        self.num_heads, self.num_kv_heads = ref_attn.num_heads, ref_attn.num_kv_heads
        self.head_dim, self.causal = ref_attn.head_dim, ref_attn.causal
        self.group, self.impl = ctx.tp_group, impl
        self.seq_sizes = impl.seq_sizes(ctx)
        self.q_heads = mappings.query_heads(self.num_heads, ctx.tp)
        self.kv_for = impl.kv_heads(self.q_heads, self.num_heads, self.num_kv_heads)
        mine_q, mine_kv = self.q_heads[ctx.tp_rank], self.kv_for[ctx.tp_rank]
        self.my_heads = torch.tensor(mine_q, dtype=torch.long)
        self.kv_index = torch.tensor(impl.kv_index(mine_q, mine_kv, self.num_heads // self.num_kv_heads),
                                     dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, s_r, H)
        a, a_kv, d = self.num_heads, self.num_kv_heads, self.head_dim  # explicit: s_r may be 0
        q = self.q_proj(x).view(b, s, a, d).transpose(1, 2)  # (B, a, s_r, d)
        k = self.k_proj(x).view(b, s, a_kv, d).transpose(1, 2)  # (B, a_kv, s_r, d)
        v = self.v_proj(x).view(b, s, a_kv, d).transpose(1, 2)  # (B, a_kv, s_r, d)
        q = self.impl.seq_to_heads(q, self.q_heads, self.seq_sizes, self.group)  # (B, h_r, S, d)
        k = self.impl.seq_to_heads(k, self.kv_for, self.seq_sizes, self.group)  # (B, kv_r, S, d)
        v = self.impl.seq_to_heads(v, self.kv_for, self.seq_sizes, self.group)  # (B, kv_r, S, d)
        # each of my query heads gets its own k/v head (a copy, as the reference's
        # repeat_interleave is), so the groups need not line up with the rank boundaries
        idx = self.kv_index.to(q.device)
        k, v = k.index_select(1, idx), v.index_select(1, idx)  # (B, h_r, S, d)
        # a rank with no heads (more ranks than heads) still sends k/v grads back in backward: the
        # empty k, v stay in its graph so it issues the same all-to-alls as every other rank
        if q.shape[1]:
            y, lse = attention(q, k, v, causal=self.causal, return_lse=True)  # (B, h_r, S, d), (B, h_r, S)
        else:
            y, lse = q + k + v, q.new_zeros(q.shape[:-1])
        # exposed for the harness's LSE check: my heads, every position (in global order)
        self.lse, self.lse_index = lse, (self.my_heads, torch.arange(q.shape[2]))
        y = self.impl.heads_to_seq(y, self.q_heads, self.seq_sizes, self.num_heads, self.group)  # (B, a, s_r, d)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, a * d))  # (B, s_r, H)


class UlyssesGPT(nn.Module):
    """tokens, positions (B, s_r) -> logits (B, s_r, V); the reference's modules, its names."""

    def __init__(self, ref: GPT, ctx: RankContext, impl: Impl):
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks = ref.tok_emb, ref.pos_emb, ref.blocks
        self.norm_f, self.lm_head = ref.norm_f, ref.lm_head
        self.ctx, self.impl = ctx, impl
        for block in self.blocks:
            block.attn = UlyssesAttention(attention_of(block), ctx, impl)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos = self.impl.positions(positions, self.ctx)  # (B, s_r): my tokens' global positions
        x = self.tok_emb(tokens) + self.pos_emb(pos)  # (B, s_r, H)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))  # (B, s_r, V)


IO_LAYOUT = Layout(seq_dim=1, batch_dim=0)
"""tokens, positions, logits and targets: (B, S) / (B, S, V), sequence-sharded over SP."""


def build_sharded(ref: GPT, ctx: RankContext, impl: Impl) -> Sharded:
    module = UlyssesGPT(ref, ctx, impl)
    return Sharded(module=module, input_layout=IO_LAYOUT, output_layout=IO_LAYOUT,
                   input_layouts={"positions": IO_LAYOUT}, replicated=("*",),
                   sync_grads=lambda: impl.sync_grads(module, ctx), local_loss=impl.local_loss)
