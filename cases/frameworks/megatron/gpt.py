"""Stage: step. megatron-core's GPTModel as the cases build it: its TransformerConfig from a case's
kwargs and the run's shapes, the layer spec, the model (shared by the TP/SP shard, the CP shard and
the module case, so none of them imports another for it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

DROPOUTS = ("hidden_dropout", "attention_dropout")
"""Off in every config: the reference and the shards must draw the same function."""


def transformer_config(kwargs: Mapping[str, Any], cfg, *, tp: int, sequence_parallel: bool,
                       dtype: torch.dtype, initialize: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    shapes = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden, num_attention_heads=cfg.num_heads,
                  ffn_hidden_size=cfg.ffn)
    return TransformerConfig(**{**{d: 0.0 for d in DROPOUTS}, **kwargs, **shapes,
                                "tensor_model_parallel_size": tp, "sequence_parallel": sequence_parallel,
                                "params_dtype": dtype, "use_cpu_initialization": True,
                                "perform_initialization": initialize})


def resolve_layer_spec(tconfig, layer_spec):
    """The user's layer spec (a `ModuleSpec`, or a function of the `TransformerConfig` returning
    one), else megatron's local spec for the config (its norm, experts and qk norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    if layer_spec is None:
        return get_gpt_layer_local_spec(num_experts=tconfig.num_moe_experts, normalization=tconfig.normalization,
                                        qk_layernorm=tconfig.qk_layernorm)
    # a ModuleSpec is callable too (it builds its module): only a function is called with the config
    return layer_spec if isinstance(layer_spec, ModuleSpec) or not callable(layer_spec) else layer_spec(tconfig)


def build_gpt(tconfig, cfg, pg_collection, *, parallel_output: bool, gpt_kwargs: Mapping[str, Any], layer_spec):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=tconfig, transformer_layer_spec=resolve_layer_spec(tconfig, layer_spec), vocab_size=cfg.vocab,
                    max_sequence_length=cfg.seq_len, parallel_output=parallel_output, pg_collection=pg_collection,
                    **gpt_kwargs)


__all__ = ["DROPOUTS", "build_gpt", "resolve_layer_spec", "transformer_config"]
