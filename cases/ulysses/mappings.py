"""DeepSpeed-Ulysses' all-to-alls (Jacobs et al. 2023, arXiv:2309.14509), for uneven shards.

Stage: step. Each is a `torch.autograd.Function` whose backward is the
conjugate all-to-all over the sequence-parallel group:

    seq_to_heads   forward: all-to-all seq->heads   backward: all-to-all heads->seq (summing)
    heads_to_seq   forward: all-to-all heads->seq   backward: all-to-all seq->heads

Shapes (B batch, A heads in the input, s_r this rank's tokens, S = sum(seq_sizes), d head dim):
seq_to_heads takes (B, A, s_r, d) and returns (B, len(heads_for[me]), S, d); heads_to_seq the
reverse. `heads_for[j]` lists the heads (indices into A) rank j gets: contiguous disjoint ranges
for query heads, possibly overlapping ranges for grouped-query k/v heads (a k/v head serving
query heads on two ranks is sent to both, so the backward SUMS what comes back for it).
`seq_sizes[j]` is rank j's token count (uneven allowed, zeros allowed).

gloo's list `dist.all_to_all` requires every tensor to have the same size (probed on torch
2.13: "ProcessGroupGloo::alltoall: invalid tensor size at index 1"), but `all_to_all_single`
takes per-rank split sizes along dim 0. The pieces here differ in two dims (heads and tokens),
so every piece is flattened and the exchange is one 1-D `all_to_all_single` with split sizes in
elements; the receiver reshapes each piece from the counts it knows. One collective per call.
With a group of one rank every mapping is a local copy and issues no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

Heads = tuple[tuple[int, ...], ...]
"""heads_for: per destination rank, the head indices it gets."""


def _rank(group) -> int:
    return dist.get_rank(group)


def _check(x: torch.Tensor, dim: int, want: int, what: str) -> None:
    if x.shape[dim] != want:
        raise ValueError(f"expected {what} = {want} along dim {dim}, got shape {tuple(x.shape)}")


def exchange(pieces: Sequence[torch.Tensor], recv_numels: Sequence[int], group) -> list[torch.Tensor]:
    """Send pieces[j] to rank j and receive a flat piece of recv_numels[j] elements from each j:
    one 1-D all_to_all_single with explicit split sizes (uneven and empty pieces allowed)."""
    if dist.get_world_size(group) == 1:
        return [pieces[0].reshape(-1).clone()]
    send = torch.cat([p.reshape(-1) for p in pieces])  # (sum of send numels,)
    recv = send.new_empty(sum(recv_numels))
    dist.all_to_all_single(recv, send, output_split_sizes=list(recv_numels),
                           input_split_sizes=[p.numel() for p in pieces], group=group)
    return list(recv.split(list(recv_numels)))


def seq_to_heads(x: torch.Tensor, heads_for: Heads, seq_sizes: Sequence[int], group) -> torch.Tensor:
    """(B, A, s_r, d) sequence shard, all heads -> (B, h_r, S, d) full sequence, my heads."""
    me = _rank(group)
    b, _, s_r, d = x.shape
    _check(x, 2, seq_sizes[me], f"rank {me}'s tokens (seq_sizes {list(seq_sizes)})")
    pieces = [x[:, list(h)] for h in heads_for]  # to rank j: (B, h_j, s_r, d)
    mine = len(heads_for[me])
    got = exchange(pieces, [b * mine * s * d for s in seq_sizes], group)  # from rank j: (B, h_r, s_j, d)
    return torch.cat([g.view(b, mine, s, d) for g, s in zip(got, seq_sizes, strict=True)], dim=2)


def heads_to_seq(y: torch.Tensor, heads_for: Heads, seq_sizes: Sequence[int], num_heads: int,
                 group) -> torch.Tensor:
    """(B, h_r, S, d) full sequence, my heads -> (B, num_heads, s_r, d) my tokens, all heads;
    a head that several ranks held (a shared k/v head) gets the SUM of their pieces."""
    me = _rank(group)
    b, mine, _, d = y.shape
    _check(y, 2, sum(seq_sizes), f"the full sequence (seq_sizes {list(seq_sizes)})")
    _check(y, 1, len(heads_for[me]), f"rank {me}'s heads {list(heads_for[me])}")
    pieces = list(y.split(list(seq_sizes), dim=2))  # to rank j: (B, h_r, s_j, d)
    s_r = seq_sizes[me]
    got = exchange(pieces, [b * len(h) * s_r * d for h in heads_for], group)  # from j: (B, h_j, s_r, d)
    out = y.new_zeros(b, num_heads, s_r, d)  # (B, A, s_r, d)
    for g, h in zip(got, heads_for, strict=True):
        if h:
            out.index_add_(1, torch.tensor(h, device=y.device), g.view(b, len(h), s_r, d))
    return out


class _SeqToHeads(torch.autograd.Function):
    """forward: all-to-all seq->heads; backward: all-to-all heads->seq (summing shared heads).

    Entering attention: each rank gives up its tokens of the other ranks' heads."""

    @staticmethod
    def forward(ctx, x, heads_for, seq_sizes, group):
        ctx.heads_for, ctx.seq_sizes, ctx.group, ctx.num_heads = heads_for, seq_sizes, group, x.shape[1]
        return seq_to_heads(x, heads_for, seq_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.heads_for, ctx.seq_sizes, ctx.num_heads, ctx.group), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    """forward: all-to-all heads->seq; backward: all-to-all seq->heads.

    Leaving attention: each rank gets back its tokens of every head (heads_for disjoint)."""

    @staticmethod
    def forward(ctx, y, heads_for, seq_sizes, num_heads, group):
        ctx.heads_for, ctx.seq_sizes, ctx.group = heads_for, seq_sizes, group
        return heads_to_seq(y, heads_for, seq_sizes, num_heads, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.heads_for, ctx.seq_sizes, ctx.group), None, None, None, None


def seq_to_heads_fn(x: torch.Tensor, heads_for: Heads, seq_sizes: Sequence[int], group) -> torch.Tensor:
    """forward: all-to-all seq->heads; backward: all-to-all heads->seq."""
    return _SeqToHeads.apply(x, tuple(map(tuple, heads_for)), tuple(seq_sizes), group)


def heads_to_seq_fn(y: torch.Tensor, heads_for: Heads, seq_sizes: Sequence[int], num_heads: int,
                    group) -> torch.Tensor:
    """forward: all-to-all heads->seq; backward: all-to-all seq->heads."""
    return _HeadsToSeq.apply(y, tuple(map(tuple, heads_for)), tuple(seq_sizes), num_heads, group)


def balanced_sizes(n: int, parts: int) -> tuple[int, ...]:
    """n items over `parts` ranks, the first n % parts ranks one more (4 heads over 3: 2/1/1;
    zeros only where parts > n). Not torch.chunk's 2/2/0: that split would idle a rank."""
    return tuple(n // parts + (r < n % parts) for r in range(parts))


def query_heads(num_heads: int, degree: int) -> Heads:
    """Contiguous query-head ranges per rank, balanced."""
    sizes, start, out = balanced_sizes(num_heads, degree), 0, []
    for n in sizes:
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def kv_heads(q_heads: Heads, num_heads: int, num_kv_heads: int) -> Heads:
    """The k/v heads each rank's query heads need: query head i uses k/v head i // (A / A_kv)
    (reference.gpt.attention's grouping). Ranges overlap where a group straddles two ranks, and
    a k/v head is sent to every rank that needs it, so fewer k/v heads than ranks is fine."""
    group = num_heads // num_kv_heads
    return tuple(tuple(range(h[0] // group, h[-1] // group + 1)) if h else () for h in q_heads)
