"""Stage: step. The two models of a yunchang case: the reference GPT with each attention's
softmax core a submodule (`blocks.N.attn.core`: `PlainCore`, exact attention on (B, S, heads, d),
its LSE kept), and the sharded core that replaces it, yunchang's `LongContextAttention`
(`YunchangCore`) with the LSE its ring returns recorded for the harness (check kind `lse`).
The projections, norms, MLPs, embeddings and head stay the reference's own, by the same names."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sp_harness.cases.common import as_gpt, attention_of, build_reference_gpt
from sp_harness.config.check_config import CheckConfig
from sp_harness.reference.gpt import Attention, attention

if TYPE_CHECKING:  # imported where its cases run (Case.setup): yunchang may not be installed
    from yunchang import LongContextAttention


class CoreAttention(nn.Module):
    """reference.gpt.Attention with its softmax core as a submodule `core`: the projections are
    the reference's own modules (same names, same params). (B, S, H) -> (B, S, H); the core maps
    q (B, S, a, d), k and v (B, S, a_kv, d) -> (B, S, a, d), yunchang's layout."""

    def __init__(self, attn: Attention, core: nn.Module):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.causal = attn.causal
        self.core = core

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, s, self.num_heads, d)  # (B, S, a, d)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, d)  # (B, S, a_kv, d)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, d)
        y = self.core(q, k, v)  # (B, S, a, d)
        return self.out_proj(y.reshape(b, s, self.num_heads * d))


class PlainCore(nn.Module):
    """The reference's attention core: exact softmax attention, its LSE kept for the harness."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        y, self.lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=self.causal,
                                return_lse=True)  # (B, a, S, d), (B, a, S)
        return y.transpose(1, 2)


@contextlib.contextmanager
def _swapped(module_name: str, attr: str, value: Any):
    module = sys.modules[module_name]
    old = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, old)


class YunchangCore(nn.Module):
    """The sharded core: yunchang's `LongContextAttention` (`self.usp`) on this rank's tokens.
    `ring_attn_fn` is wrapped to pass `return_attn_probs=True` (the layer unpacks the tuple and
    returns the same output) and keep the LSE it returns; `swaps` (a mutant's: name -> value)
    replace names in the ring implementation's module for the duration of the forward call only
    (set and restored around it), so no other job in the process sees them."""

    def __init__(self, usp: LongContextAttention, causal: bool, lse_index: tuple[torch.Tensor, torch.Tensor],
                 swaps: Mapping[str, Any] | None = None):
        super().__init__()
        self.usp, self.causal, self.lse_index, self.lse = usp, causal, lse_index, None
        ring_fn = usp.ring_attn_fn
        ring_module = ring_fn.__module__

        def recording(*args, **kwargs):
            kwargs["return_attn_probs"] = True
            with contextlib.ExitStack() as stack:
                for attr, value in (swaps or {}).items():
                    stack.enter_context(_swapped(ring_module, attr, value))
                out = ring_fn(*args, **kwargs)
            self.lse = out[1].detach()  # (B, heads here, my Ulysses group's tokens)
            return out

        usp.ring_attn_fn = recording

    def forward(self, q, k, v):
        return self.usp(q, k, v, causal=self.causal)


def build_reference(config: CheckConfig) -> nn.Module:
    """The reference GPT, each attention's core a `PlainCore` submodule."""
    model = as_gpt(build_reference_gpt(config))
    for block in model.blocks:
        attn = attention_of(block)
        block.attn = CoreAttention(attn, PlainCore(attn.causal))
    return model


__all__ = ["CoreAttention", "PlainCore", "YunchangCore", "build_reference"]
