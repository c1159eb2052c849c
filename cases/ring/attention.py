"""Ring attention: each rank's queries against every rank's keys/values, one block per ring step.

Per layer: W-1 `ring_shift`s forward (k and v travel as one tensor), W-1 backward. Each block's
partial attention is masked from the blocks' GLOBAL positions, skipped when fully masked, and
merged into the running output by log-sum-exp (online softmax) in float32 for low-precision runs.
Backward is autograd through these ops and through the shifts (sp_harness.cases.ring.mappings).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sp_harness.cases.ring.mappings import Ring, keep, ring_shift
from sp_harness.cases.ring.placement import ORDERS, block_mask
from sp_harness.reference.gpt import Attention

Partial = tuple[torch.Tensor, torch.Tensor]
"""A partial attention: its normalised output (B, a, s_q, d) and log-sum-exp (B, a, s_q, 1)."""


def lse_merge(acc: Partial, part: Partial) -> Partial:
    """Two partials of one softmax over disjoint key sets, merged exactly by their log-sum-exps."""
    (out, lse), (out_b, lse_b) = acc, part
    new = torch.logaddexp(lse, lse_b)  # (B, a, s_q, 1)
    # a row no key reached yet has lse -inf on both sides: keep its exponents finite
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    return out * (lse - safe).exp() + out_b * (lse_b - safe).exp(), new


def merge_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and the merge run in float32 at least (bf16 exponents lose the sum)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Partial:
    """Softmax attention of (B, a, s_q, d) queries over one (B, a_kv, s_k, d) k/v block under a
    (s_q, s_k) mask -> its Partial. Rows the mask empties get output 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # grouped-query: each k/v head serves `group` consecutive query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, a, s_k, d)
    acc = merge_dtype(q.dtype)
    s = ((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])).to(acc)  # (B, a, s_q, s_k)
    s = torch.where(mask, s, torch.full_like(s, float("-inf")))
    # the max only stabilises the exponent (it cancels), so it carries no grad
    m = s.amax(-1, keepdim=True).detach()  # (B, a, s_q, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = (s - m).exp()  # (B, a, s_q, s_k), masked entries exactly 0
    total = p.sum(-1, keepdim=True)  # (B, a, s_q, 1)
    reached = total > 0
    total = torch.where(reached, total, torch.ones_like(total))  # no 0/0 in forward or backward
    out = (p.to(v.dtype) @ v).to(acc) / total  # (B, a, s_q, d)
    lse = torch.where(reached, total.log() + m, torch.full_like(m, float("-inf")))
    return out, lse


@dataclass(kw_only=True, frozen=True)
class Impl:
    """The pieces of a ring-attention implementation a mutant may swap for a broken one."""

    placement: Callable[[str], Callable[[int, tuple[int, ...]], torch.Tensor]] = ORDERS.__getitem__
    """load_balancer -> Layout.seq_order: where each rank's tokens sit."""
    shift: Callable[[torch.Tensor, Ring, int], torch.Tensor] = ring_shift
    """One ring step of a k/v block (differentiable)."""
    mask: Callable[[torch.Tensor, torch.Tensor, bool, str], torch.Tensor] = (
        lambda q_pos, k_pos, causal, balancer: block_mask(q_pos, k_pos, causal))
    """(q positions, k positions, causal, load_balancer) -> the block's (s_q, s_k) mask."""
    merge: Callable[[Partial, Partial], Partial] = lse_merge
    """How two partial attentions combine."""
    keys_dropped: Callable[[torch.Tensor, int, int, str], torch.Tensor] | None = None
    """(k positions, seq_len, W, load_balancer) -> bool per key left out of the ring; None: none."""
    mask_placement: Callable[[str], Callable[[int, tuple[int, ...]], torch.Tensor]] | None = None
    """The placement the attention masks assume; None: `placement`, where the tokens really are."""
    exposed_lse: Callable[[torch.Tensor], torch.Tensor] = lambda lse: lse
    """The merged (natural-log) log-sum-exp -> what the implementation returns to its callers."""


CORRECT = Impl()


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: Ring, positions, causal: bool,
                   balancer: str, seq_len: int, impl: Impl, work: list[int] | None = None,
                   lse: list[torch.Tensor] | None = None) -> torch.Tensor:
    """(B, a, s, d) local queries, (B, a_kv, s, d) local keys/values -> (B, a, s, d) local output.
    `positions[r]` are ring rank r's global positions; `work` gets the unmasked pairs computed,
    `lse` the merged log-sum-exp of each local query (B, a, s), as the implementation exposes it."""
    kv = torch.cat([k, v], dim=1)  # (B, 2 a_kv, s, d): one message per step
    received, acc = [], None
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        if step:
            kv = impl.shift(kv, ring, ring.seq_shards[src])
            received.append(kv)
        mask = impl.mask(positions[ring.rank], positions[src], causal, balancer)  # (s_q, s_k)
        if impl.keys_dropped is not None:
            mask = mask & ~impl.keys_dropped(positions[src], seq_len, ring.size, balancer)[None, :]
        if not bool(mask.any()):
            continue  # block skipping: nothing to score (and nothing to count as work)
        if work is not None:
            work.append(int(mask.sum()))
        k_blk, v_blk = kv.chunk(2, dim=1)  # (B, a_kv, s_k, d) each
        part = block_attention(q, k_blk, v_blk, mask.to(q.device))
        acc = part if acc is None else impl.merge(acc, part)
    out = torch.zeros_like(q) if acc is None else acc[0].to(q.dtype)
    if lse is not None:
        final = (torch.full(q.shape[:-1], float("-inf"), dtype=merge_dtype(q.dtype), device=q.device) if acc is None
                 else impl.exposed_lse(acc[1].squeeze(-1).detach()))  # (B, a, s)
        lse.append(final)
    return keep(out, q, k, v, *received)


class RingAttention(Attention):
    """The reference's attention (same projections, names and weights), attention by ring."""

    def setup(self, *, ring: Ring, positions, balancer: str, seq_len: int, impl: Impl) -> RingAttention:
        self.ring, self.positions, self.balancer, self.seq_len, self.impl = ring, positions, balancer, seq_len, impl
        self.work: list[int] = []
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, s, H): this rank's tokens
        # head counts spelled out: an empty shard (s = 0) cannot infer a -1
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # (B, a, s, d)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, a_kv, s, d)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, a_kv, s, d)
        lse: list[torch.Tensor] = []
        y = ring_attention(q, k, v, ring=self.ring, positions=self.positions, causal=self.causal,
                           balancer=self.balancer, seq_len=self.seq_len, impl=self.impl, work=self.work, lse=lse)
        # exposed for the harness's LSE check: my rows are every head at my tokens' global positions
        self.lse = lse[0]  # (B, a, s)
        self.lse_index = (torch.arange(self.num_heads), self.positions[self.ring.rank])
        return self.out_proj(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))  # (B, s, H)


def to_ring(attn: Attention, **setup) -> RingAttention:
    """Turn the reference's Attention into a RingAttention in place (weights kept)."""
    attn.__class__ = RingAttention
    assert isinstance(attn, RingAttention)
    return attn.setup(**setup)
