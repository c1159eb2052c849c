"""Megatron-style tensor-parallel layers with an optional sequence-parallel mode.

Stage: step. `Parallel` is what a layer knows about its rank: the TP group, the mode
and, under SP, the sequence dim and the per-rank sequence sizes. Its `enter` / `exit` are the
two region changes of Megatron's ColumnParallelLinear / RowParallelLinear:

    TP only:  enter = copy_to_tp (fwd identity, bwd all-reduce)
              exit  = reduce_from_tp (fwd all-reduce, bwd identity)
    TP + SP:  enter = gather_from_sp (fwd all-gather on seq, bwd reduce-scatter)
              exit  = reduce_scatter_to_sp (fwd reduce-scatter on seq, bwd all-gather)

Between an exit and the next enter the activations are replicated (TP) or sequence shards (SP);
norms run there. Every parameter carries `sp_kind` (None for tensor-parallel weights) and, under
SP, `sequence_parallel = True` when the `Impl` says its grads are partial sums over TP.

Splits follow torch.chunk's convention (`sp_harness.config.shards.chunk_sizes`): 5 heads over tp=2 are
3/2, ffn 64 over tp=3 is 22/22/20; a trailing rank may hold zero heads (4 heads over tp=3 are
2/2/0), which works: its attention is empty and its row-parallel partial product is zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from sp_harness.cases.megatron.impl import Impl


@dataclass(frozen=True)
class Parallel:
    impl: Impl
    group: dist.ProcessGroup
    tp: int
    tp_rank: int
    sequence_parallel: bool
    seq_dim: int
    """Sequence dim of the activations (1 for [b, s, h], 0 for [s, b, h])."""
    seq_sizes: tuple[int, ...]
    """Tokens per TP rank (SP), or (seq_len,) in TP-only mode."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel region: the full sequence, replicated."""
        if self.sequence_parallel:
            return self.impl.gather_from_sp(x, self.seq_dim, self.seq_sizes, self.group)
        return self.impl.copy_to_tp(x, self.group)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel region: summed partial products, as sequence shards under SP."""
        if self.sequence_parallel:
            return self.impl.reduce_scatter_to_sp(x, self.seq_dim, self.seq_sizes, self.group)
        return self.impl.reduce_from_tp(x, self.group)

    def mark(self, param: torch.Tensor, kind: str | None) -> torch.Tensor:
        """Tag a parameter with its kind; under SP mark it the way Megatron does (setattr on the
        parameter, read back with getattr)."""
        setattr(param, "sp_kind", kind)  # noqa: B010 (an attribute no Tensor type declares)
        if self.sequence_parallel and kind in self.impl.sequence_parallel_kinds:
            setattr(param, "sequence_parallel", True)  # noqa: B010
        return param


class ColumnParallelLinear(nn.Module):
    """y = x A_r^T + b_r with the output features split over TP (`sizes` per rank).

    `forward(x)` enters the region itself; several linears sharing one input (q, k, v) call
    `parallel.enter` once and pass `entered=True` (one all-gather, as Megatron's fused QKV)."""

    def __init__(self, in_features: int, sizes: tuple[int, ...], parallel: Parallel, bias=True):
        super().__init__()
        self.parallel = parallel
        self.sizes = sizes
        out_local = sizes[parallel.tp_rank]
        self.weight = parallel.mark(nn.Parameter(torch.empty(out_local, in_features)), None)
        self.bias = parallel.mark(nn.Parameter(torch.empty(out_local)), None) if bias else None
        self.split = {"weight": (0, sizes), "bias": (0, sizes)}

    def forward(self, x: torch.Tensor, entered: bool = False) -> torch.Tensor:
        if not entered:
            x = self.parallel.enter(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r A_r^T + b with the input features split over TP (`sizes` per rank); the
    bias is replicated and added once, after the reduction (and on the shard under SP)."""

    def __init__(self, sizes: tuple[int, ...], out_features: int, parallel: Parallel, bias=True):
        super().__init__()
        self.parallel = parallel
        self.sizes = sizes
        in_local = sizes[parallel.tp_rank]
        self.weight = parallel.mark(nn.Parameter(torch.empty(out_features, in_local)), None)
        self.bias = parallel.mark(nn.Parameter(torch.empty(out_features)), "row_bias") if bias else None
        self.split = {"weight": (1, sizes)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.impl.row_parallel(x, self.weight, self.bias, self.parallel.exit)


class LayerNorm(nn.Module):
    """LayerNorm with affine weight and bias, numerically nn.LayerNorm's (F.layer_norm)."""

    def __init__(self, hidden: int, eps: float, parallel: Parallel):
        super().__init__()
        self.eps = eps
        self.weight = parallel.mark(nn.Parameter(torch.empty(hidden)), "norm")
        self.bias = parallel.mark(nn.Parameter(torch.empty(hidden)), "norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm with an affine weight, the same expression as reference.gpt.RMSNorm."""

    def __init__(self, hidden: int, eps: float, parallel: Parallel):
        super().__init__()
        self.eps = eps
        self.weight = parallel.mark(nn.Parameter(torch.empty(hidden)), "norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, hidden: int, eps: float, parallel: Parallel) -> nn.Module:
    if kind == "layernorm":
        return LayerNorm(hidden, eps, parallel)
    if kind == "rmsnorm":
        return RMSNorm(hidden, eps, parallel)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split over TP (`head_sizes` heads per rank).

    q/k/v are column-parallel (their input entered once: under SP all-gathered, so attention
    sees the full sequence), out_proj row-parallel. Works in either activation layout."""

    def __init__(self, hidden: int, head_dim: int, head_sizes: tuple[int, ...], parallel: Parallel):
        super().__init__()
        self.parallel = parallel
        self.head_dim = head_dim
        self.local_heads = head_sizes[parallel.tp_rank]
        rows = tuple(n * head_dim for n in head_sizes)
        self.q_proj = ColumnParallelLinear(hidden, rows, parallel)
        self.k_proj = ColumnParallelLinear(hidden, rows, parallel)
        self.v_proj = ColumnParallelLinear(hidden, rows, parallel)
        self.out_proj = RowParallelLinear(rows, hidden, parallel)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """Local projection -> (B, a_local, S, d), from [b, s, .] or [s, b, .]."""
        if self.parallel.seq_dim == 1:
            b, s, _ = t.shape
            return t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        s, b, _ = t.shape
        return t.view(s, b, self.local_heads, self.head_dim).permute(1, 2, 0, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.parallel.enter(x)  # full sequence
        q = self._heads(self.q_proj(x, entered=True))  # (B, a_r, S, d)
        k = self._heads(self.k_proj(x, entered=True))
        v = self._heads(self.v_proj(x, entered=True))
        s = q.shape[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, a_r, S, S)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = att @ v  # (B, a_r, S, d)
        b = y.shape[0]
        if self.parallel.seq_dim == 1:
            y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        else:
            y = y.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.out_proj(y)  # exit: all-reduce (TP) or reduce-scatter (SP)


class ParallelMLP(nn.Module):
    """fc1 column-parallel (ffn split by `ffn_sizes`), GELU, fc2 row-parallel."""

    def __init__(self, hidden: int, ffn_sizes: tuple[int, ...], parallel: Parallel):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_sizes, parallel)
        self.fc2 = RowParallelLinear(ffn_sizes, hidden, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))
