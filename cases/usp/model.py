"""The USP twin of reference.gpt.GPT: Ulysses all-to-alls inside a ring of Ulysses groups.

Stage: step. Every parameter is a REPLICATED copy of the reference's (the reference's
own submodules); every activation outside attention is sequence-sharded over the SP group. SP
rank t = (r, u) (groups.py). Attention per block, on rank (r, u):

    q, k, v = projections of my tokens            (B, a, s_t, d), (B, a_kv, s_t, d) x 2
    all-to-all seq->heads in my Ulysses group     (B, h_u, S_r, d): my group's tokens, my heads
    ring attention over my ring                   (B, h_u, S_r, d): every group's k/v visits
    all-to-all heads->seq in my Ulysses group     (B, a, s_t, d)
    out_proj                                      (B, s_t, H)

The ring's members all have the same u, so they hold the same heads; ring rank r's k/v block is
its Ulysses group's S_r tokens, masked by THOSE tokens' global positions (the concatenation of
the members' positions, member by member, as the all-to-all lays them out), never by the rank's
own shard. Per layer: 4 all-to-alls forward and 4 backward over the Ulysses group (none when
U = 1), R-1 ring sends forward and R-1 backward (sp_harness.cases.ring.attention).

`Impl` gathers what a mutant (cases/usp/mutants.py) may swap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sp_harness.cases.common import attention_of, known, sum_replicated_grads
from sp_harness.cases.ring import attention as ring_attn
from sp_harness.cases.ring.mappings import Ring
from sp_harness.cases.ring.placement import rank_positions
from sp_harness.cases.ulysses import mappings
from sp_harness.cases.ulysses.model import kv_index
from sp_harness.cases.usp.groups import Grid, group_positions
from sp_harness.cases.usp.placement import usp_order
from sp_harness.config.case import Layout, Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.reference.gpt import GPT, Attention


def sync_grads(module: nn.Module, ctx: RankContext, grid: Grid) -> None:
    """Every grad is a partial sum over the whole SP group (each rank's loss covers its tokens,
    and a Ulysses rank's attention grads cover its heads only): SUM over SP, then the DP average.
    A param this rank's tokens never reached gets a zero grad first (the all-reduce needs it):
    ring-gpt's sync, over the whole SP group."""
    sum_replicated_grads(module, ctx)


@dataclass(frozen=True, kw_only=True)
class Impl:
    """Every piece of the implementation a bug could live in. `CORRECT` is the right one."""

    placement: Callable[[str, int], Callable[[int, tuple[int, ...]], torch.Tensor]] = usp_order
    """(load_balancer, ring_degree) -> Layout.seq_order: where each SP rank's tokens sit."""
    mask_placement: Callable[[str, int], Callable[[int, tuple[int, ...]], torch.Tensor]] | None = None
    """The placement the ring's masks assume; None: `placement`, where the tokens really are."""
    ring: ring_attn.Impl = ring_attn.CORRECT
    """The ring attention's own pieces (shift, mask, merge)."""
    sync_grads: Callable[[nn.Module, RankContext, Grid], None] = sync_grads
    local_loss: Callable | None = None


CORRECT = Impl()


def _repeat_compatible(index: list[int], num_kv: int) -> bool:
    """Whether query head i of mine uses received k/v head i // (h / kv): then the ring can carry
    the kv heads themselves and block_attention's repeat_interleave pairs them up."""
    h = len(index)
    return num_kv > 0 and h % num_kv == 0 and index == [i // (h // num_kv) for i in range(h)]


class USPAttention(nn.Module):
    """Attention on sequence shards: all-to-all in the Ulysses group, ring over the ring group."""

    def __init__(self, ref_attn: Attention, ctx: RankContext, grid: Grid, positions: tuple, impl: Impl):
        super().__init__()
        # the reference's own Linear modules: same parameter names, replicated weights
        self.q_proj, self.k_proj = ref_attn.q_proj, ref_attn.k_proj
        self.v_proj, self.out_proj = ref_attn.v_proj, ref_attn.out_proj
        self.num_heads, self.num_kv_heads = ref_attn.num_heads, ref_attn.num_kv_heads
        self.head_dim, self.causal = ref_attn.head_dim, ref_attn.causal
        self.grid, self.impl, self.positions = grid, impl, positions
        self.config = ctx.config
        # the all-to-all's split sizes: my Ulysses group's members' tokens
        self.seq_sizes = tuple(ctx.seq_shards[t] for t in grid.members(grid.r))
        self.q_heads = mappings.query_heads(self.num_heads, grid.ulysses_degree)
        self.kv_for = mappings.kv_heads(self.q_heads, self.num_heads, self.num_kv_heads)
        mine_q, mine_kv = self.q_heads[grid.u], self.kv_for[grid.u]
        index = kv_index(mine_q, mine_kv, self.num_heads // self.num_kv_heads)
        # k/v travel the ring with as few heads as the grouping allows
        self.kv_index = None if _repeat_compatible(index, len(mine_kv)) else torch.tensor(index, dtype=torch.long)
        self.ring = Ring(rank=grid.r, ranks=grid.ring_ranks, group=grid.ring_group,
                         seq_shards=grid.group_shards(ctx.seq_shards))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, s_t, H)
        a, a_kv, d = self.num_heads, self.num_kv_heads, self.head_dim  # explicit: s_t may be 0
        group = self.grid.ulysses_group
        q = self.q_proj(x).view(b, s, a, d).transpose(1, 2)  # (B, a, s_t, d)
        k = self.k_proj(x).view(b, s, a_kv, d).transpose(1, 2)  # (B, a_kv, s_t, d)
        v = self.v_proj(x).view(b, s, a_kv, d).transpose(1, 2)  # (B, a_kv, s_t, d)
        q = mappings.seq_to_heads_fn(q, self.q_heads, self.seq_sizes, group)  # (B, h_u, S_r, d)
        k = mappings.seq_to_heads_fn(k, self.kv_for, self.seq_sizes, group)  # (B, kv_u, S_r, d)
        v = mappings.seq_to_heads_fn(v, self.kv_for, self.seq_sizes, group)  # (B, kv_u, S_r, d)
        if self.kv_index is not None:  # a group straddling my heads unevenly: one k/v per q head
            idx = self.kv_index.to(q.device)
            k, v = k.index_select(1, idx), v.index_select(1, idx)  # (B, h_u, S_r, d)
        lse: list[torch.Tensor] = []
        if q.shape[1]:
            y = ring_attn.ring_attention(q, k, v, ring=self.ring, positions=self.positions, causal=self.causal,
                                         balancer=known(self.config.load_balancer, "load_balancer"),
                                         seq_len=known(self.config.seq_len, "seq_len"),
                                         impl=self.impl.ring, lse=lse)  # (B, h_u, S_r, d)
        else:
            # no heads here (more Ulysses ranks than heads): neither has any rank of my ring, so
            # the ring is skipped by all of them; k, v stay in the graph for the backward all-to-alls
            y = q + k + v  # (B, 0, S_r, d)
            lse.append(q.new_zeros(q.shape[:-1]))
        # exposed for the harness's LSE check: my Ulysses heads at my group's tokens' global positions
        self.lse = lse[0]  # (B, h_u, S_r)
        self.lse_index = (torch.tensor(self.q_heads[self.grid.u], dtype=torch.long), self.positions[self.ring.rank])
        y = mappings.heads_to_seq_fn(y, self.q_heads, self.seq_sizes, a, group)  # (B, a, s_t, d)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, a * d))  # (B, s_t, H)


class USPGPT(nn.Module):
    """tokens, positions (B, s_t) -> logits (B, s_t, V); the reference's modules, its names."""

    def __init__(self, ref: GPT, ctx: RankContext, grid: Grid, positions: tuple, impl: Impl):
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks = ref.tok_emb, ref.pos_emb, ref.blocks
        self.norm_f, self.lm_head = ref.norm_f, ref.lm_head
        for block in self.blocks:
            block.attn = USPAttention(attention_of(block), ctx, grid, positions, impl)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, s_t, H): global positions
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))  # (B, s_t, V)


def build_sharded(ref: GPT, ctx: RankContext, grid: Grid, impl: Impl) -> Sharded:
    balancer, seq_len = known(ctx.config.load_balancer, "load_balancer"), known(ctx.config.seq_len, "seq_len")
    order = impl.placement(balancer, grid.ring_degree)
    masked_as = order if impl.mask_placement is None else impl.mask_placement(balancer, grid.ring_degree)
    sp_positions = rank_positions(masked_as(seq_len, ctx.seq_shards), ctx.seq_shards)
    positions = group_positions(grid, sp_positions, ctx.seq_shards)  # per ring rank
    module = USPGPT(ref, ctx, grid, positions, impl)
    layout = Layout(seq_dim=1, batch_dim=0, seq_order=order)
    return Sharded(module=module, input_layout=layout, output_layout=layout, replicated=("*",),
                   sync_grads=lambda: impl.sync_grads(module, ctx, grid), local_loss=impl.local_loss)
