"""Stage: step. Models of torchtitan's registry other than llama3, built as torchtitan builds its
own flavors, with its own sharding config set on them (`torchtitan_case(..., model="qwen3")`).

- qwen3 (`torchtitan.models.qwen3`): `_build_qwen3_layers` (fused wqkv with GQA, per-head QK
  RMSNorm before RoPE, real-valued `CosSinRoPE`, SwiGLU FFN), `Qwen3Model.Config` with tied
  embeddings by default (its flavors tie `tok_embeddings` and `lm_head` up to 4B), and
  `set_qwen3_sharding_config(config, enable_sp=..., enable_ep=False)`: llama3's decoder plan plus
  the QK norms' own config (weight `R` on TP, input sharded on the head dim, `S(2)`), whose
  weight grad is a partial sum over the TP ranks' heads until it is reduced.
- deepseek_v3 (`torchtitan.models.deepseek_v3`): `_build_dsv3_layers` (multi-head latent
  attention: a colwise `wq` (q_lora_rank 0) or low-rank `wq_a`/`q_norm`/`wq_b`, the joint KV
  down-projection `wkv_a` and `kv_norm` replicated, the colwise up-projection `wkv_b`, RoPE on a
  separate `qk_rope_head_dim` slice, a v head dim of its own; `n_dense_layers` dense SwiGLU
  layers, then MoE layers: a replicated top-k router, `GroupedExperts` on `torch._grouped_mm`
  and shared experts), YaRN-scaled complex RoPE, untied embeddings, no MTP layers,
  `DeepSeekV3Model.Config`, and `set_deepseek_v3_sharding_config(config, enable_sp=...,
  enable_ep=False)`: the routed experts' weights sharded on their hidden dim over TP (w1/w3
  `S(1)`, w2 `S(2)`), every TP rank routing all tokens (the router's input gathered to `R`), the
  experts' `Partial` output reduce-scattered to the sequence shard. `GroupedExperts` computes in
  bfloat16 whatever the model's dtype (`x.bfloat16()` into `_grouped_mm`), the float64 reference
  too: a float32 / float64 run names that island. The router's load-balancing buffers
  (`expert_bias_E`, `tokens_per_expert_E`) are moved only by torchtitan's optimizer hook
  (`register_moe_load_balancing_hook`), which no check runs: the bias stays zero on both sides,
  and buffers are not compared. UNSUPPORTED before ranks start (`dsv3_limits`): `--num-kv-heads`
  (MLA has none), dims `_grouped_mm` cannot take (16-byte strides: dim and the expert hidden dim
  per TP rank multiples of 8), hidden dims TP does not divide, and context parallelism with a v
  head dim other than the qk head dim (torch's CPU flash kernel refuses it; SDPA's math fallback
  is not sharded by torch's ring).
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


DSV3_KEYS = ("dim", "n_layers", "n_heads", "vocab_size", "n_dense_layers", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "dense_hidden_dim", "moe_hidden_dim",
             "num_experts", "num_shared_experts", "top_k", "score_func", "route_norm", "route_scale",
             "load_balance_coeff", "rope_theta", "rope_factor", "mscale", "max_seq_len", "norm_eps")
"""The shapes `deepseek_v3_config` reads (`torchtitan_case(..., model="deepseek_v3")`'s model kwargs)."""

_GROUPED_MM_ALIGN = 8
"""`torch._grouped_mm` takes bfloat16 operands whose leading strides are multiples of 16 bytes
(its meta check, `_meta_grouped_mm_common`): 8 elements. `GroupedExperts` feeds it the tokens
(stride dim) and each rank's expert weights (strides dim and the local expert hidden dim)."""


def _dsv3_shapes(shapes: Mapping[str, Any]) -> dict[str, Any]:
    """deepseek_v3's shapes with the defaults filled: head dims from dim / n_heads (the rope
    slice half of it), kv_lora_rank dim / 2, dense_hidden_dim 4 * dim, moe_hidden_dim dim, and
    its `_debugmodel` flavor's routing (8 experts, 2 shared, top 3 of softmax scores) and YaRN."""
    dim, n_heads = shapes["dim"], shapes["n_heads"]
    head = dim // n_heads
    return {"n_dense_layers": 1, "q_lora_rank": 0, "kv_lora_rank": dim // 2, "qk_nope_head_dim": head,
            "qk_rope_head_dim": head // 2, "v_head_dim": head, "dense_hidden_dim": 4 * dim, "moe_hidden_dim": dim,
            "num_experts": 8, "num_shared_experts": 2, "top_k": 3, "score_func": "softmax", "route_norm": False,
            "route_scale": 1.0, "load_balance_coeff": 1e-3, "rope_theta": 10000.0, "rope_factor": 40.0,
            "mscale": 0.70, "max_seq_len": 256, "norm_eps": 1e-5, **{k: v for k, v in shapes.items() if v is not None}}


def dsv3_limits(cfg: Any, shapes: Mapping[str, Any], *, tp: int, context_parallel: int = 1) -> str | None:
    """Why a run of deepseek_v3 of these shapes (the case's, with the run's --hidden, ... on top)
    at TP `tp` and CP `context_parallel` cannot be verified, None where it can."""
    if cfg.num_kv_heads not in (None, cfg.num_heads):
        return f"deepseek_v3's MLA has no KV heads (num_kv_heads {cfg.num_kv_heads}): one latent KV for all heads"
    s = _dsv3_shapes(shapes)
    qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
    if context_parallel > 1 and s["v_head_dim"] != qk:
        # measured: "aten.add.Tensor got mixed torch.Tensor and DTensor" in the attention's SDPA
        return (f"deepseek_v3 under context parallelism with v_head_dim {s['v_head_dim']} != qk head dim {qk}: torch's "
                f"CPU flash kernel needs equal q/k/v head dims, and SDPA's math fallback is not sharded by torch's "
                f"CP ring (make v_head_dim = qk_nope_head_dim + qk_rope_head_dim)")
    for key in ("dense_hidden_dim", "moe_hidden_dim"):  # colwise / rowwise on TP (the shared experts' too)
        if s[key] % tp:
            return f"deepseek_v3: {key} ({s[key]}) is not divisible by the TP degree ({tp})"
    local = s["moe_hidden_dim"] // tp
    if s["dim"] % _GROUPED_MM_ALIGN or local % _GROUPED_MM_ALIGN:
        return (f"deepseek_v3: torch._grouped_mm needs 16-byte strides (multiples of {_GROUPED_MM_ALIGN} bfloat16 "
                f"elements): dim {s['dim']}, moe_hidden_dim / TP {local}")
    if s["qk_rope_head_dim"] % 2:
        return f"deepseek_v3: qk_rope_head_dim ({s['qk_rope_head_dim']}) must be even (complex RoPE pairs)"
    return None


def deepseek_v3_config(shapes: Mapping[str, Any], *, enable_sp: bool = True, attn_backend: str = "sdpa",
                       edit_sharding: Callable[[Any], None] | None = None):
    """A torchtitan `DeepSeekV3Model.Config` of the given shapes (defaults: `_dsv3_shapes`),
    built as its `_debugmodel` flavor is (`_build_dsv3_layers`, YaRN complex RoPE, untied
    embeddings, no MTP layers), with `set_deepseek_v3_sharding_config(enable_ep=False)` set on it.
    `attn_backend` and `edit_sharding`: as `llama3_config`'s (SDPA takes MLA's qk head dim and its
    own v head dim). On a torch without triton call torchtitan's `cpu_shims()` first."""
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    s = _dsv3_shapes(shapes)
    dim, vocab, eps = s["dim"], s["vocab_size"], s["norm_eps"]
    layers = D._build_dsv3_layers(
        n_layers=s["n_layers"], n_dense_layers=s["n_dense_layers"], dim=dim, n_heads=s["n_heads"],
        q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], mscale=s["mscale"],
        dense_hidden_dim=s["dense_hidden_dim"], moe_hidden_dim=s["moe_hidden_dim"], num_experts=s["num_experts"],
        num_shared_experts=s["num_shared_experts"], router_top_k=s["top_k"], router_score_func=s["score_func"],
        router_route_norm=s["route_norm"], router_route_scale=s["route_scale"],
        attn_backend="flex" if attn_backend == "sdpa" else attn_backend, moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=s["qk_rope_head_dim"], max_seq_len=s["max_seq_len"], theta=s["rope_theta"],
                                scaling="yarn", rope_factor=s["rope_factor"], beta_fast=32.0, beta_slow=1.0,
                                original_seq_len=4096))
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = layer.attention.kv_norm.eps = eps
        if layer.moe is not None:
            layer.moe.load_balance_coeff = s["load_balance_coeff"]
        if attn_backend == "sdpa":
            # as qwen3_config: torchtitan's get_attention_config refuses "sdpa" for language models;
            # one document per row, where causal SDPA is the mask
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = D.DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=D._output_linear_init(dim)),
        layers=layers)
    set_deepseek_v3_sharding_config(config, enable_sp=enable_sp, enable_ep=False)
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
    limits: Callable[..., str | None] = lambda cfg, shapes, *, tp, context_parallel: None
    """(run config, the case's shapes with the run's on top, *, tp=the run's TP degree,
    context_parallel=the case's CP degree) -> why that run cannot be verified for this model
    (None: it can), decided before any rank starts."""


MODELS: dict[str, RegistryModel] = {
    "qwen3": RegistryModel(keys=QWEN3_KEYS, config=qwen3_config, package="torchtitan.models.qwen3"),
    "deepseek_v3": RegistryModel(keys=DSV3_KEYS, config=deepseek_v3_config, package="torchtitan.models.deepseek_v3",
                                 limits=dsv3_limits),
}
"""The registry models beyond llama3 (which `torchtitan.llama3_config` builds), by their
registry name."""

UNWIRED: dict[str, str] = {
    "gpt_oss": "its attention sinks rescale each head by the attention's log-sum-exp, which only torchtitan's "
               "varlen (CUDA) and flex inner attentions return, and FlexAttention has no backward on CPU",
    "qwen3_5": "its Gated DeltaNet layers call flash-linear-attention's triton kernels (fla), which a CPU torch "
               "cannot run",
    "kimi_k2_7": "a vision-language model (a vision encoder before its decoder); the case feeds text tokens only",
    "muse_glimmer": "a vision-language model (a vision encoder before its decoder); the case feeds text tokens only",
    "flux": "a diffusion model, not a causal language model: the case's batch is tokens and next-token labels",
}
"""The rest of torchtitan's registry (`torchtitan.models._supported_models`), each with why
`torchtitan_case` does not build it here: a case naming one is UNSUPPORTED with that reason
before any rank starts. A test keeps this table and `MODELS` covering the whole registry."""


def retie(model: nn.Module) -> None:
    """Tied embeddings (qwen3's flavors) tied again after `Module.parallelize`, which gives the
    embedding and the lm_head a sharded param each: torchtitan's own re-tie, the first line of
    `Decoder.init_states` (its trainer parallelizes on meta, then runs init_states), without the
    init that follows (the state here is the reference's, loaded before parallelize)."""
    if getattr(model, "enable_weight_tying", False):
        model.get_submodule("tok_embeddings").weight = model.get_submodule("lm_head").weight


__all__ = ["DSV3_KEYS", "MODELS", "QWEN3_KEYS", "UNWIRED", "RegistryModel", "deepseek_v3_config", "dsv3_limits", "qwen3_config",
           "retie"]
