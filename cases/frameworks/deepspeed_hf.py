"""Stage: step. DeepSpeed's `UlyssesSPAttentionHF` (Arctic Long Sequence Training,
`deepspeed.runtime.sequence_parallel.ulysses_sp`) as a system under test: registered with
transformers by its own `register_with_transformers` over a core attention (`sdpa`), on an HF
`LlamaForCausalLM` (tiny by default), sequence-sharded over the run's SP group and checked
against the same model unsharded; grads by DeepSpeed's engine.

    from sp_harness.cases.frameworks.deepspeed_hf import hf_ulysses_case
    HF_LLAMA = hf_ulysses_case("my-ds-ulysses-hf-llama", dict(num_key_value_heads=2))

The reference is built in the reference process, where `register_with_transformers` never runs.
Each job puts transformers' own attention function back and releases DeepSpeed's SP groups
before it registers, so every job registers exactly once over the plain attention, as a new
process would. DeepSpeed's process state (setup, launcher env, comm backend): `deepspeed_runtime`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness import Batch, Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.common import GPT_DEFAULTS, gpt_batch, gpt_tokens, known, with_positions
from sp_harness.cases.frameworks.deepspeed_runtime import (
    DEEPSPEED_VERSION,
    deepspeed_setup,
    init_distributed,
    launcher_env,
)
from sp_harness.reference.gpt import token_loss_sum

TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
"""A tiny `LlamaConfig` (2 layers, hidden 32, 4 heads, vocab 64); initializer_range 0.2 so the
logits are far from uniform at init (HF's 0.02 gives near-zero grads)."""


class CausalLMLogits(nn.Module):
    """An HF causal LM called on named tensors, returning its logits (B, S, V) (the harness
    judges tensors; HF returns a ModelOutput). The LM's params keep their names under `lm.`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


_ORIGINAL_ATTENTION: dict[str, Any] = {}


def _register_ulysses_hf(model: nn.Module, *, core: str, sp: int, batch: int, seq_len: int):
    """DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` for this job. It replaces
    transformers' global `ALL_ATTENTION_FUNCTIONS[core]` by its wrapper and makes DeepSpeed's SP
    groups; a warm rank process's next job first puts back transformers' own function and
    releases the groups, so every job registers exactly once over the plain attention, as a
    new process would (the references run in processes this never touches)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as ps
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _ORIGINAL_ATTENTION.setdefault(core, ALL_ATTENTION_FUNCTIONS[core])
    ALL_ATTENTION_FUNCTIONS[core] = _ORIGINAL_ATTENTION[core]
    ps._release_sequence_parallel_groups()
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=core, sequence_parallel_size=sp,
        micro_batch_size=batch, seq_length=seq_len, seq_length_is_variable=False)


def _hf_setup() -> None:
    """Per process: DeepSpeed's setup plus transformers' Llama import."""
    deepspeed_setup()
    import transformers.models.llama.modeling_llama  # noqa: F401


def hf_ulysses_case(name: str, llama_config: Mapping[str, Any] | None = None, *, core_attn: str = "sdpa",
                    **case_fields: Any) -> Case:
    """A `Case` checking DeepSpeed's `UlyssesSPAttentionHF` (registered with transformers by its
    `register_with_transformers`, `core_attn` its core attention) on an HF `LlamaForCausalLM`
    built from `llama_config` (LlamaConfig keywords over `TINY_LLAMA`; its shapes become the
    case's defaults, which --hidden, --num-heads, ... override), sequence-sharded
    over the run's SP group, against the same model unsharded. Grads: DeepSpeed's engine with the
    mpu `register_with_transformers` returns (float32 / bfloat16, as `ulysses_case`). The loss is
    the harness's token cross entropy on the logits (HF's own shifted loss is not used: the
    targets are already the next tokens)."""
    kwargs = {**TINY_LLAMA, **(llama_config or {})}
    case_fields.setdefault("setup", _hf_setup)

    def llama(cfg, dtype):
        from transformers import LlamaConfig, LlamaForCausalLM

        shapes = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                      num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
                      max_position_embeddings=max(64, cfg.seq_len))
        torch.manual_seed(cfg.seed)
        config = LlamaConfig(**{**kwargs, **shapes}, attn_implementation=core_attn)
        return CausalLMLogits(LlamaForCausalLM(config).to(dtype))

    def validate(cfg) -> None:
        sp = cfg.world_size // cfg.dp
        a, a_kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
        if cfg.seq_len % sp or (cfg.seq_shards is not None and len(set(cfg.seq_shards)) > 1):
            raise Unsupported(f"UlyssesSPAttentionHF needs seq_len / sp tokens on every rank (its required_query_shape): "
                              f"seq_len {cfg.seq_len}, sp {sp}")
        if sp > 1 and (a % sp or (a_kv % sp and sp % a_kv)):
            raise Unsupported(f"UlyssesSPAttentionHF: num_attention_heads ({a}) must be divisible by sp ({sp}), and "
                              f"num_key_value_heads ({a_kv}) divisible by sp or sp by it")
        if cfg.layout not in (None, "bsh") or cfg.ring_degree not in (None, 1) or \
                cfg.load_balancer not in (None, "none") or cfg.causal is False:
            raise Unsupported("UlyssesSPAttentionHF on an HF Llama: [b, s, h] inputs, causal, pure Ulysses, contiguous")
        if cfg.dtype == "float64":
            raise Unsupported("DeepSpeed's engine reduces grads only in its accelerator's supported_dtypes "
                              "(float32, bfloat16, float16): 'attempting to reduce an unsupported grad type: torch.float64'")

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        import deepspeed
        from deepspeed.utils import groups

        cfg = ctx.config
        launcher_env(ctx)
        groups.mpu = None
        ctx.once("deepspeed-init-distributed", init_distributed)
        mpu = _register_ulysses_hf(reference.get_submodule("lm"), core=core_attn, sp=ctx.tp,
                                  batch=known(cfg.batch, "batch"), seq_len=known(cfg.seq_len, "seq_len"))
        if mpu is not None and tuple(dist.get_process_group_ranks(mpu.get_sequence_parallel_group())) != ctx.tp_ranks:
            raise RuntimeError(f"DeepSpeed's SP group {dist.get_process_group_ranks(mpu.get_sequence_parallel_group())} "
                               f"is not the harness's {ctx.tp_ranks}")
        config = {"train_micro_batch_size_per_gpu": cfg.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 0}}
        engine, *_ = deepspeed.initialize(model=reference, config=config, mpu=mpu)
        io = Layout(seq_dim=1, batch_dim=0)
        return Sharded(module=reference, input_layout=io, output_layout=io, input_layouts={"position_ids": io},
                       replicated=("*",), sync_grads=engine.allreduce_gradients)

    def make_batch(cfg, step, gen) -> Batch:
        made = with_positions(*gpt_batch(cfg, step, gen))
        return Batch(inputs={"input_ids": made.inputs["tokens"], "position_ids": made.inputs["positions"]},
                     target=made.target)

    shapes = dict(vocab=kwargs["vocab_size"], hidden=kwargs["hidden_size"], ffn=kwargs["intermediate_size"],
                  num_layers=kwargs["num_hidden_layers"], num_heads=kwargs["num_attention_heads"],
                  num_kv_heads=kwargs["num_key_value_heads"])
    defaults = {**GPT_DEFAULTS, **shapes, "dtype": "float32", **case_fields.pop("defaults", {})}
    return Case(name=name, description=f"DeepSpeed {DEEPSPEED_VERSION} UlyssesSPAttentionHF ({core_attn}) on an HF Llama",
                build_reference=lambda cfg: llama(cfg, torch.float64), make_batch=make_batch, shard=shard,
                loss_sum=token_loss_sum, tokens=gpt_tokens, input_layout=Layout(seq_dim=1, batch_dim=0),
                validate=validate, defaults=defaults,
                tags=("deepspeed", "ulysses", "transformers", "framework", *case_fields.pop("tags", ())), **case_fields)


__all__ = ["TINY_LLAMA", "CausalLMLogits", "hf_ulysses_case"]
