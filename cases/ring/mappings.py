"""The ring's one collective, Megatron mappings style: an autograd.Function per exchange.

Each forward step passes this rank's current key/value block to the next rank of the ring and
receives the previous rank's; backward passes the received block's grad back the other way, so
the grad of a k/v block lands on the rank whose projections made it (and autograd adds it to the
grad of the block that rank used itself). Point-to-point over gloo (`dist.isend` / `dist.irecv`,
both posted before either is waited on, so a ring of any size cannot deadlock).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(kw_only=True, frozen=True)
class Ring:
    """This rank's place in the context-parallel ring."""

    rank: int
    """Index in the ring (the TP rank)."""
    ranks: tuple[int, ...]
    """Global ranks of the ring, in ring order."""
    group: dist.ProcessGroup | None
    """The context-parallel process group."""
    seq_shards: tuple[int, ...]
    """Tokens per ring rank (the length of each rank's k/v block)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


def exchange(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int, group) -> torch.Tensor:
    """Send `send` to global rank `to` while receiving `recv` from `frm`; both posted first."""
    ops = [dist.isend(send.contiguous(), to, group=group), dist.irecv(recv, frm, group=group)]
    for op in ops:
        if op is None:  # torch hands None only to a rank outside `group`
            raise RuntimeError(f"exchange with ranks {to} and {frm} from a rank outside their group")
        op.wait()
    return recv


class _RingShift(torch.autograd.Function):
    """forward: send the k/v block to the next ring rank, return the previous rank's block
    (its length `recv_len` on the sequence dim -2); backward: send the grad of the received block
    back to the previous rank, return the grad received from the next rank."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, ring: Ring, recv_len: int) -> torch.Tensor:
        ctx.ring, ctx.shape = ring, kv.shape
        shape = kv.shape[:-2] + (recv_len, kv.shape[-1])
        return exchange(kv, ring.next, kv.new_empty(shape), ring.prev, ring.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ring = ctx.ring
        back = exchange(grad, ring.prev, grad.new_empty(ctx.shape), ring.next, ring.group)
        return back, None, None


def ring_shift(kv: torch.Tensor, ring: Ring, recv_len: int) -> torch.Tensor:
    return _RingShift.apply(kv, ring, recv_len)


class _Keep(torch.autograd.Function):
    """forward: `out` unchanged; backward: `out`'s grad, and zeros for every tensor in `rest`.

    Ties every received k/v block (and q) into the graph even where block skipping left it
    unused (a fully masked block, an empty shard): autograd then runs every `_RingShift` backward
    on every rank, so the backward exchanges pair up instead of leaving a neighbour waiting."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype) for t in rest]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(grad.new_zeros(s, dtype=d) for s, d in ctx.shapes))


def keep(out: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return _Keep.apply(out, *rest)
