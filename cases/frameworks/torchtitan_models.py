"""Stage: step. Models of torchtitan's registry other than llama3, built as torchtitan builds its
own flavors, with its own sharding config set on them (`torchtitan_case(..., model="qwen3")`).

- qwen3 (`torchtitan.models.qwen3`): `_build_qwen3_layers` (fused wqkv with GQA, per-head QK
  RMSNorm before RoPE, real-valued `CosSinRoPE`, SwiGLU FFN), `Qwen3Model.Config` with tied
  embeddings by default (its flavors tie `tok_embeddings` and `lm_head` up to 4B), and
  `set_qwen3_sharding_config(config, enable_sp=..., enable_ep=False)`: llama3's decoder plan plus
  the QK norms' own config (weight `R` on TP, input sharded on the head dim, `S(2)`), whose
  weight grad is a partial sum over the TP ranks' heads until it is reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

QWEN3_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "head_dim", "hidden_dim", "rope_theta",
              "max_seq_len", "fuse_qkv", "norm_eps", "tie_embeddings")
"""The shapes `qwen3_config` reads (`torchtitan_case(..., model="qwen3")`'s model kwargs)."""


def qwen3_config(shapes: Mapping[str, Any], *, enable_sp: bool = True, attn_backend: str = "sdpa",
                 edit_sharding: Callable[[Any], None] | None = None):
    """A torchtitan `Qwen3Model.Config` of the given shapes, built as its `_debugmodel` flavor is
    (n_kv_heads defaults to n_heads, head_dim to dim / n_heads, hidden_dim to 4 * dim), with
    `set_qwen3_sharding_config` set on it. `attn_backend` and `edit_sharding`: as `llama3_config`'s.
    On a torch without triton call torchtitan's `cpu_shims()` first (`model_config` does)."""
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    dim, vocab, n_heads = shapes["dim"], shapes["vocab_size"], shapes["n_heads"]
    head_dim = shapes.get("head_dim") or dim // n_heads
    tied = shapes.get("tie_embeddings", True)
    layers = Q._build_qwen3_layers(
        n_layers=shapes["n_layers"], dim=dim, n_heads=n_heads, n_kv_heads=shapes.get("n_kv_heads") or n_heads,
        head_dim=head_dim, hidden_dim=shapes.get("hidden_dim") or 4 * dim, fuse_qkv=shapes.get("fuse_qkv", True),
        attn_backend="flex" if attn_backend == "sdpa" else attn_backend,
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=shapes.get("max_seq_len", 256),
                               theta=shapes.get("rope_theta", 1000000.0)))
    eps = shapes.get("norm_eps", Q._EPS)
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = layer.attention.qk_norm.eps = eps
        if attn_backend == "sdpa":
            # torchtitan's get_attention_config refuses "sdpa" for language models (SDPA cannot take
            # per-document positions); the case feeds one document per row, where causal SDPA is the mask
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    norm = Q._qwen3_norm(dim)
    norm.eps = eps
    config = Q.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=norm, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=Q._EMBEDDING_SKIP_INIT if tied else Q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=Q._LINEAR_INIT),
        layers=layers)
    set_qwen3_sharding_config(config, enable_sp=enable_sp, enable_ep=False)
    if edit_sharding is not None:
        edit_sharding(config)
    return config


@dataclass(kw_only=True, frozen=True)
class RegistryModel:
    """A model of torchtitan's registry that `torchtitan_case(..., model=NAME)` builds."""

    keys: tuple[str, ...]
    """The shapes its config builder reads (the case's model kwargs); dim, n_layers, n_heads and
    vocab_size among them (the run's --hidden, --num-layers, --num-heads, --vocab)."""
    config: Callable[..., Any]
    """(shapes, *, enable_sp, attn_backend, edit_sharding) -> its `Config`, built as torchtitan
    builds its own flavors, with its own sharding config set on it."""
    package: str
    """Its torchtitan package: it and its `.sharding` are imported in each rank's setup (before
    any job's clock)."""
    limits: Callable[[Any], str | None] = lambda cfg: None
    """Why a run config cannot be verified for this model (None: it can), from the config alone."""


MODELS: dict[str, RegistryModel] = {
    "qwen3": RegistryModel(keys=QWEN3_KEYS, config=qwen3_config, package="torchtitan.models.qwen3"),
}
"""The registry models beyond llama3 (which `torchtitan.llama3_config` builds), by their
registry name."""


def retie(model: nn.Module) -> None:
    """Tied embeddings (qwen3's flavors) tied again after `Module.parallelize`, which gives the
    embedding and the lm_head a sharded param each: torchtitan's own re-tie, the first line of
    `Decoder.init_states` (its trainer parallelizes on meta, then runs init_states), without the
    init that follows (the state here is the reference's, loaded before parallelize)."""
    if getattr(model, "enable_weight_tying", False):
        model.get_submodule("tok_embeddings").weight = model.get_submodule("lm_head").weight


__all__ = ["MODELS", "QWEN3_KEYS", "RegistryModel", "qwen3_config", "retie"]
