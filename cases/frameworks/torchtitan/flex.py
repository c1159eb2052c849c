"""Stage: step. torchtitan's FlexAttention with packed-document masks
(`torchtitan_case(..., attn_backend="flex", documents=N)`): its llama3 flavors' attention.

What runs on the sharded side is torchtitan's: each row packs `documents` documents, whose
`positions` restart at 0 (what its text datasets yield), and before each forward the model's own
`get_attention_masks(positions=...)` builds the causal + packed-document `BlockMask`, as its
trainer's `post_dataloading_process` does (a forward pre-hook, so module names stay
torchtitan's); its `FlexAttention` runs `flex_attention` compiled, with RoPE at the same
positions.

The reference is ours, written independently of flex: the same model with each layer's inner
attention a dense SDPA (`DenseDocumentAttention`) under a boolean mask built from the positions
(a key is visible where it is in the query's document and not after it). torch's CPU flex kernel
has no backward and no float64, so on CPU the check is forward-only (`--forward-only yes`: the
output and the loss are judged, not the grads) in float32 or bfloat16 (`flex_limits`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FLEX_ON_CPU = ("FlexAttention does not support backward on CPU (torch 2.13.0's NotImplementedError, eager and "
               "compiled alike): run it with --forward-only yes (the output and the loss judged), or use "
               "attn_backend='sdpa' (torchtitan's ScaledDotProductAttention) on CPU")
FLEX_DTYPES_ON_CPU = ("torch's CPU FlexAttention kernel takes float32, float16 and bfloat16 only (its inductor "
                      "lowering's NotImplementedError for float64)")


INDUCTOR_CACHE = pathlib.Path.home() / ".cache" / "sp-harness" / "torchinductor"
"""Where the rank processes of a FlexAttention case keep inductor's compiled kernels. torch puts
them under TMPDIR by default, which every rank pool makes its own and removes on close, so each
pool compiled torchtitan's flex kernel again (C++, 40 s of a 45 s check on 2 cores). The cache is
keyed by the kernel's source and compile options: a hit loads the same kernel, the math is
unchanged. `TORCHINDUCTOR_CACHE_DIR`, where set, wins."""


def use_inductor_cache() -> None:
    """Part of a flex case's per-process setup: inductor's cache in `INDUCTOR_CACHE`."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))


def flex_limits(cfg) -> str | None:
    """Why a FlexAttention run cannot be verified on this machine (None: it can)."""
    if torch.cuda.is_available():
        return "torchtitan's FlexAttention on CUDA is not wired into this case (unverified here)"
    if not cfg.forward_only:
        return FLEX_ON_CPU
    if cfg.dtype == "float64":
        return FLEX_DTYPES_ON_CPU
    return None


def document_positions(rows: int, seq_len: int, documents: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, seq_len) int64: each row `documents` packed documents of random lengths (each at
    least one token), positions restarting at 0 where a document starts."""
    if not 1 <= documents <= seq_len:
        raise ValueError(f"documents {documents}: needs 1 <= documents <= seq_len ({seq_len})")
    out = torch.empty(rows, seq_len, dtype=torch.int64)
    for r in range(rows):
        starts = torch.cat([torch.zeros(1, dtype=torch.int64),
                            (torch.randperm(seq_len - 1, generator=gen)[:documents - 1] + 1).sort().values])
        doc = torch.zeros(seq_len, dtype=torch.int64)
        doc[starts] = 1
        doc = doc.cumsum(0) - 1  # (S,) document index
        out[r] = torch.arange(seq_len) - starts[doc]
    return out


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """bool (B, 1, S, S): query q sees key k where both are in one document and k <= q, the
    documents read off the positions (a new one wherever a position is 0)."""
    doc = (positions == 0).cumsum(-1)  # (B, S)
    same = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(positions.shape[-1], positions.shape[-1], dtype=torch.bool).tril()
    return (same & causal)[:, None]


class DenseDocumentAttention(nn.Module):
    """The reference's inner attention: SDPA under the dense document mask the model's forward
    pre-hook hands it as `attention_masks` (torchtitan's Attention passes it through)."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: torch.Tensor, scale: float | None = None,
                enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                             attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)  # (B, L, N, H)


def _positions_of(args: tuple, kwargs: dict) -> torch.Tensor:
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    assert positions is not None, "a documents batch passes positions"
    return positions


def reference_documents(model: Any) -> None:
    """The reference side: every layer's inner attention the dense one, fed the mask built from
    the forward's positions."""
    for block in model.layers.values():
        block.attention.inner_attention = DenseDocumentAttention()

    def pre(module, args, kwargs):
        kwargs["attention_masks"] = document_mask(_positions_of(args, kwargs))
        return args, kwargs

    model.register_forward_pre_hook(pre, with_kwargs=True)


def titan_documents(model: Any, *, see_documents: bool = True) -> None:
    """The sharded side: torchtitan's own masks from the positions before each forward, as its
    trainer's `post_dataloading_process` builds them. `see_documents=False`: the mask built as if
    every row were one document, causal only (a mutant's: cross-document attention)."""

    def pre(module, args, kwargs):
        positions = _positions_of(args, kwargs)
        if not see_documents:
            positions = torch.arange(positions.shape[-1]).expand_as(positions)
        kwargs["attention_masks"] = module.get_attention_masks(positions=positions)
        return args, kwargs

    model.register_forward_pre_hook(pre, with_kwargs=True)


__all__ = ["FLEX_DTYPES_ON_CPU", "FLEX_ON_CPU", "INDUCTOR_CACHE", "use_inductor_cache", "DenseDocumentAttention", "document_mask", "document_positions",
           "flex_limits", "reference_documents", "titan_documents"]
