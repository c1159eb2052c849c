"""Stage: step. The models of a yunchang case. The user's side is a model factory
`model(config, attention) -> nn.Module` whose every attention core is made by `attention()` and
called the way yunchang's layers are (`core(q, k, v, causal=..., softmax_scale=...)` on
(B, S, heads, head_dim)); the reference gets `ReferenceAttention` cores (exact attention, its LSE
kept), the sharded twin the same model with each core replaced by yunchang's
`LongContextAttention` or `UlyssesAttention` (`YunchangCore`, which records the LSE the layer's
kernel returns for the harness: check kind `lse`). The built-in factory is `gpt_model`: the
project's GPT with each attention's softmax core a submodule (`blocks.N.attn.core`), the
projections, norms, MLPs, embeddings and head the reference's own, by the same names."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from sp_harness.cases.common import as_gpt, attention_of, build_reference_gpt
from sp_harness.config.check_config import CheckConfig
from sp_harness.reference.gpt import Attention, attention

ModelFactory = Callable[[CheckConfig, Callable[[], nn.Module]], nn.Module]
"""`model(config, attention)`: the user's model for a run's config, each attention core made by
calling `attention()` (where their training code constructs `LongContextAttention(...)` or
`UlyssesAttention(...)`) and called as yunchang's layers are."""


class ReferenceAttention(nn.Module):
    """The reference's attention core, with yunchang's layer call: q (B, S, a, d), k and v
    (B, S, a_kv, d) -> (B, S, a, d), exact softmax attention (grouped-query heads, causal from the
    top left, scale `softmax_scale` or 1/sqrt(d)); its LSE (B, a, S) kept for the harness."""

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args: Any):
        if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
            raise NotImplementedError("the reference attention core computes exact attention only: no dropout, "
                                      "sliding window, softcap or ALiBi")
        q = query.transpose(1, 2)  # (B, a, S, d)
        if softmax_scale is not None and softmax_scale != query.shape[-1] ** -0.5:
            q = q * (softmax_scale * math.sqrt(query.shape[-1]))  # `attention` scales by 1/sqrt(d)
        y, self.lse = attention(q, key.transpose(1, 2), value.transpose(1, 2), causal=causal, return_lse=True)
        return y.transpose(1, 2)


class CoreAttention(nn.Module):
    """reference.gpt.Attention with its softmax core as a submodule `core`: the projections are
    the reference's own modules (same names, same params). (B, S, H) -> (B, S, H)."""

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
        y = self.core(q, k, v, causal=self.causal)  # (B, S, a, d)
        return self.out_proj(y.reshape(b, s, self.num_heads * d))


def gpt_model(config: CheckConfig, make_attention: Callable[[], nn.Module]) -> nn.Module:
    """The built-in model factory: the reference GPT, each attention's core `make_attention()`."""
    model = as_gpt(build_reference_gpt(config))
    for block in model.blocks:
        block.attn = CoreAttention(attention_of(block), make_attention())
    return model


def build_reference(config: CheckConfig) -> nn.Module:
    """The reference GPT, each attention's core a `ReferenceAttention` submodule."""
    return gpt_model(config, ReferenceAttention)


def core_names(model: nn.Module) -> list[str]:
    """The names of a built model's attention cores (its `ReferenceAttention` modules)."""
    return [name for name, m in model.named_modules() if isinstance(m, ReferenceAttention)]


@contextlib.contextmanager
def _swapped(module_name: str, attr: str, value: Any):
    module = sys.modules[module_name]
    old = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, old)


class _Swaps:
    """Names of one module replaced between `enter` and `exit` (idempotent both ways)."""

    def __init__(self, module_name: str, swaps: Mapping[str, Any]):
        self.module_name, self.swaps = module_name, dict(swaps)
        self.stack: contextlib.ExitStack | None = None

    def enter(self) -> None:
        self.exit()
        stack = self.stack = contextlib.ExitStack()
        for attr, value in self.swaps.items():
            stack.enter_context(_swapped(self.module_name, attr, value))

    def exit(self) -> None:
        if self.stack is not None:
            self.stack.close()
            self.stack = None


class _EnterOnBackward(torch.autograd.Function):
    """Identity on the ring's output; its backward (which runs just before the ring's) sets the swaps."""

    @staticmethod
    def forward(ctx, swaps: _Swaps, out: torch.Tensor):
        ctx.swaps = swaps
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.swaps.enter()
        return None, grad


class _ExitOnBackward(torch.autograd.Function):
    """Identity on the ring's q, k, v; its backward (which runs once the ring's has made their
    grads) restores the names."""

    @staticmethod
    def forward(ctx, swaps: _Swaps, q, k, v):
        ctx.swaps = swaps
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.swaps.exit()
        return None, dq, dk, dv


class YunchangCore(nn.Module):
    """The sharded core: yunchang's layer (`self.usp`: `LongContextAttention` or `UlyssesAttention`)
    on this rank's tokens. The LSE of the kernel the layer calls is recorded for the harness:
    LongContextAttention's `ring_attn_fn` (the merged LSE of the ring) or UlyssesAttention's
    `attn_fn` (flash-attn's), each wrapped to pass `return_attn_probs=True` (the layer unpacks the
    tuple and returns the same output); `record_lse=False` where the kernel computes none
    (yunchang's torch math path returns zeros). `lse_index` is (heads, positions) given the
    query's head count (this rank's Ulysses heads, its Ulysses group's tokens).

    A mutant's swaps replace names of the module that computes (the ring implementation's for
    LongContextAttention, `yunchang.ulysses.attn_layer` for UlyssesAttention): `swaps` for the
    duration of the forward call only, `backward_swaps` for the ring's backward only (set by an
    identity on the ring's output whose backward runs just before the ring's, restored by one on
    its inputs whose backward runs just after), so no other job in the process sees them."""

    def __init__(self, usp: nn.Module, lse_index: Callable[[int], tuple[torch.Tensor, torch.Tensor]], *,
                 swaps: Mapping[str, Any] | None = None, backward_swaps: Mapping[str, Any] | None = None,
                 record_lse: bool = True):
        super().__init__()
        self.usp, self._lse_index, self.lse, self.lse_index = usp, lse_index, None, None
        self.record_lse = record_lse
        ring = hasattr(usp, "ring_attn_fn")
        inner = usp.ring_attn_fn if ring else usp.attn_fn
        self._forward_swaps = _Swaps(inner.__module__ if ring else type(usp).__module__, swaps or {})
        self._backward_swaps = _Swaps(inner.__module__, backward_swaps or {}) if backward_swaps else None
        if backward_swaps and not ring:
            raise ValueError("backward_swaps patch a ring's backward: UlyssesAttention has no ring")

        def recording(q, k, v, *args, **kwargs):
            kwargs["return_attn_probs"] = True
            bwd = self._backward_swaps
            if bwd is not None:
                bwd.exit()  # a backward that raised left them set
                q, k, v = _ExitOnBackward.apply(bwd, q, k, v)
            with contextlib.ExitStack() as stack:
                if ring:  # a Ulysses layer's forward swaps span its whole forward (its all-to-alls)
                    self._forward_swaps.enter()
                    stack.callback(self._forward_swaps.exit)
                out = inner(q, k, v, *args, **kwargs)
            if self.record_lse:
                self.lse = out[1].detach()  # (B, heads here, my Ulysses group's tokens)
            if bwd is not None:
                out = (_EnterOnBackward.apply(bwd, out[0]), *out[1:])
            return out

        # a plain attribute on yunchang's module (typed by torch as a Tensor or Module)
        setattr(usp, "ring_attn_fn" if ring else "attn_fn", recording)

    def forward(self, q, k, v, *args, **kwargs):
        if self.record_lse:
            self.lse_index = self._lse_index(q.shape[2])
        if hasattr(self.usp, "ring_attn_fn"):
            return self.usp(q, k, v, *args, **kwargs)
        self._forward_swaps.enter()
        try:
            return self.usp(q, k, v, *args, **kwargs)
        finally:
            self._forward_swaps.exit()


__all__ = ["CoreAttention", "ModelFactory", "ReferenceAttention", "YunchangCore", "build_reference", "core_names",
           "gpt_model"]
