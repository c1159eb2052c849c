"""Stage: step. DeepSpeed's `UlyssesSPAttentionHF` (Arctic Long Sequence Training,
`deepspeed.runtime.sequence_parallel.ulysses_sp`) as a system under test: registered with
transformers by its own `register_with_transformers` over a core attention (`sdpa`), on an HF
causal LM (Llama, Qwen2, Mistral: `MODEL_TYPES`; tiny by default), sequence-sharded over the
run's SP group and checked against the same model unsharded; grads by DeepSpeed's engine (ZeRO
0/1/2) or, for float64, which the engine refuses, its sums written out.

    from sp_harness.cases.frameworks.deepspeed.hf import hf_ulysses_case
    HF_QWEN2 = hf_ulysses_case("my-ds-hf-qwen2", dict(num_key_value_heads=2), model_type="qwen2")

The reference is built in the reference process, where `register_with_transformers` never runs.
Each job puts transformers' own attention function back and releases DeepSpeed's SP groups
before it registers, so every job registers exactly once over the plain attention, as a new
process would. DeepSpeed's process state (setup, launcher env, comm backend): `deepspeed_runtime`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness import Batch, Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.common import GPT_DEFAULTS, gpt_batch, gpt_tokens, known, with_positions
from sp_harness.cases.frameworks import releases
from sp_harness.cases.frameworks.deepspeed import compat
from sp_harness.cases.frameworks.deepspeed.case import (
    check_engine_args,
    engine_limits,
    grad_sync_of,
    zero_release_limits,
)
from sp_harness.cases.frameworks.deepspeed.loss import case_loss_fields, loss_limits, sp_local_loss, token_batch
from sp_harness.cases.frameworks.deepspeed.runtime import (
    DEEPSPEED_PRELOAD,
    DEEPSPEED_VERSION,
    init_distributed,
    launcher_env,
)
from sp_harness.cases.frameworks.token_loss import TokenLoss
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
_ORIGINAL_EXCHANGE: dict[str, Callable] = {}


def _install_exchange(exchange: Callable | None) -> None:
    """`ulysses_sp._dim_zero_all_to_all` (UlyssesSPAttentionHF's sequence <-> heads exchange) for
    this job: DeepSpeed's own, or a mutant's replacement; set by every job, as cases share a
    warm process."""
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    if not hasattr(ulysses_sp, "_dim_zero_all_to_all"):
        # before 0.19.7 the exchange is `_DimZeroAllToAll.apply`, not a module function: nothing
        # to put back (a replacement is refused in the case's validate: compat.MODULE_EXCHANGE)
        if exchange is not None:
            raise Unsupported(compat.unsupported_without(compat.MODULE_EXCHANGE, "a replaced exchange"))
        return
    own = _ORIGINAL_EXCHANGE.setdefault("a2a", ulysses_sp._dim_zero_all_to_all)
    ulysses_sp._dim_zero_all_to_all = exchange or own


def _register_ulysses_hf(model: nn.Module, *, core: str, sp: int, batch: int, seq_len: int):
    """DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` for this job. It replaces
    transformers' global `ALL_ATTENTION_FUNCTIONS[core]` by its wrapper and makes DeepSpeed's SP
    groups; a warm rank process's next job first puts back transformers' own function and
    releases the groups, so every job registers exactly once over the plain attention, as a
    new process would (the references run in processes this never touches)."""
    reset_ulysses_hf(core)
    return compat.register_ulysses_hf(model, core=core, sp=sp, batch=batch, seq_len=seq_len)


def reset_ulysses_hf(core: str) -> None:
    """What a new process has before `register_with_transformers` runs: transformers' own
    `ALL_ATTENTION_FUNCTIONS[core]` (an earlier job's registration replaced it by DeepSpeed's
    wrapper) and no DeepSpeed SP groups. Also what the HF Trainer's SP path needs before
    accelerate registers (sp_harness.cases.frameworks.hf.sp)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _ORIGINAL_ATTENTION.setdefault(core, ALL_ATTENTION_FUNCTIONS[core])
    ALL_ATTENTION_FUNCTIONS[core] = _ORIGINAL_ATTENTION[core]
    compat.release_sp_groups(compat.sp_groups_module())


MODEL_TYPES = ("llama", "qwen2", "mistral")
"""HF model types checked here (transformers 5.23.0): decoder-only causal LMs whose attention
calls transformers' `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` with q/k/v
(B, heads, S, d) and `position_ids`, which is what `UlyssesSPAttentionHF` replaces. Another
model type of that shape is taken by `hf_ulysses_case(..., model_type=...)` too."""


def _hf_model_config(model_type: str, kwargs: Mapping[str, Any], core_attn: str):
    """transformers' own config class for `model_type`, or a ValueError naming the valid ones."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model_type {model_type!r} is not a transformers model type (e.g. {', '.join(MODEL_TYPES)})")
    return AutoConfig.for_model(model_type, **kwargs, attn_implementation=core_attn)


def hf_ulysses_case(name: str, model_config: Mapping[str, Any] | None = None, *, model_type: str = "llama",
                    core_attn: str = "sdpa", grad_sync: str = "engine", ds_config: Mapping[str, Any] | None = None,
                    position_ids: str = "global", loss: TokenLoss | None = None, exchange: Callable | None = None,
                    **case_fields: Any) -> Case:
    """A `Case` checking DeepSpeed's `UlyssesSPAttentionHF` (registered with transformers by its
    `register_with_transformers`, `core_attn` its core attention) on an HF causal LM of
    `model_type` ("llama", "qwen2", "mistral": `MODEL_TYPES`) built by
    `AutoModelForCausalLM.from_config` from `model_config` (that model type's config keywords over
    `TINY_LLAMA`'s shapes; its shapes become the case's defaults, which --hidden, --num-heads, ...
    override), sequence-sharded over the run's SP group, against the same model unsharded.
    Grads: DeepSpeed's engine with the mpu `register_with_transformers` returns (float32 /
    bfloat16; `ds_config` as `ulysses_case`'s: ZeRO 0/1/2), or `grad_sync="all-reduce"` (the
    engine's sums written out, float64 too). The loss is the harness's token cross entropy on the
    logits (HF's own shifted loss is not used: the targets are already the next tokens).
    `position_ids`: what each rank hands the model, "global" (its tokens' positions in the whole
    sequence, as UlyssesSPDataLoaderAdapter shards them) or "local" (0..s/sp-1: a mutant's knob).
    `loss`: your labels (-100 on the prompt, loss-masked and pad positions), label smoothing or
    loss function (`TokenLoss`; deepspeed_loss: no attention mask, as ALST takes position_ids).
    `exchange`: a replacement for DeepSpeed's `_dim_zero_all_to_all` (a mutant's knob)."""
    kwargs = {**TINY_LLAMA, **(model_config or {})}
    check_engine_args(name, grad_sync, ds_config)
    if position_ids not in ("global", "local"):
        raise ValueError(f"{name!r}: position_ids must be 'global' or 'local', got {position_ids!r}")
    if model_type not in MODEL_TYPES:  # a bad model type is an error where the case is made (the
        _hf_model_config(model_type, {}, core_attn)  # known ones skip transformers' import: 1.5-3 s a process)
    case_fields.setdefault("preload", (*DEEPSPEED_PRELOAD, "transformers.models.auto.modeling_auto"))

    def causal_lm(cfg, dtype):
        from transformers import AutoModelForCausalLM

        shapes = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                      num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
                      max_position_embeddings=max(64, cfg.seq_len))
        torch.manual_seed(cfg.seed)
        config = _hf_model_config(model_type, {**kwargs, **shapes}, core_attn)
        return CausalLMLogits(AutoModelForCausalLM.from_config(config).to(dtype))

    def validate(cfg) -> None:
        releases.require(compat.__name__, name)
        if compat.lacks(compat.ULYSSES_HF):
            raise Unsupported(compat.unsupported_without(compat.ULYSSES_HF, name))
        if exchange is not None and compat.lacks(compat.MODULE_EXCHANGE):
            raise Unsupported(compat.unsupported_without(compat.MODULE_EXCHANGE, f"{name} (its replaced exchange)"))
        zero_release_limits(name, ds_config)
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
            raise Unsupported(f"UlyssesSPAttentionHF on an HF {model_type}: [b, s, h] inputs, causal, pure Ulysses, "
                              f"contiguous")
        engine_limits(cfg, grad_sync=grad_sync, ds_config=ds_config)
        if loss is not None:
            loss_limits(cfg, loss)

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        from deepspeed.utils import groups

        cfg = ctx.config
        launcher_env(ctx)
        groups.mpu = None
        ctx.once("deepspeed-init-distributed", init_distributed)
        _install_exchange(exchange)
        mpu = _register_ulysses_hf(reference.get_submodule("lm"), core=core_attn, sp=ctx.tp,
                                  batch=known(cfg.batch, "batch"), seq_len=known(cfg.seq_len, "seq_len"))
        if mpu is not None and tuple(dist.get_process_group_ranks(mpu.get_sequence_parallel_group())) != ctx.tp_ranks:
            raise RuntimeError(f"DeepSpeed's SP group {dist.get_process_group_ranks(mpu.get_sequence_parallel_group())} "
                               f"is not the harness's {ctx.tp_ranks}")
        sync = grad_sync_of(reference, ctx, grad_sync=grad_sync, mpu=mpu, ds_config=ds_config)
        io = Layout(seq_dim=1, batch_dim=0)
        return Sharded(module=reference, input_layout=io, output_layout=io, input_layouts={"position_ids": io},
                       replicated=("*",), sync_grads=sync, prepare_inputs=prepare,
                       local_loss=None if loss is None else sp_local_loss(loss))

    def prepare(pieces: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
        if position_ids == "local":
            pos = pieces["position_ids"]
            return {**pieces, "position_ids": pos - pos[:, :1]}
        return pieces

    def make_batch(cfg, step, gen) -> Batch:
        made = with_positions(*(gpt_batch(cfg, step, gen) if loss is None else token_batch(loss, cfg, step, gen)))
        return Batch(inputs={"input_ids": made.inputs["tokens"], "position_ids": made.inputs["positions"]},
                     target=made.target)

    shapes = dict(vocab=kwargs["vocab_size"], hidden=kwargs["hidden_size"], ffn=kwargs["intermediate_size"],
                  num_layers=kwargs["num_hidden_layers"], num_heads=kwargs["num_attention_heads"],
                  num_kv_heads=kwargs["num_key_value_heads"])
    defaults = {**GPT_DEFAULTS, **shapes, "dtype": "float32" if grad_sync == "engine" else "float64",
                **case_fields.pop("defaults", {})}
    case_fields = {"loss_sum": token_loss_sum, "tokens": gpt_tokens,
                   **(case_loss_fields(loss) if loss is not None else {}), **case_fields}
    return Case(name=name, description=f"DeepSpeed {DEEPSPEED_VERSION} UlyssesSPAttentionHF ({core_attn}) on an HF "
                                       f"{model_type}, grads by {grad_sync}",
                build_reference=lambda cfg: causal_lm(cfg, torch.float64), make_batch=make_batch, shard=shard,
                input_layout=Layout(seq_dim=1, batch_dim=0),
                validate=validate, defaults=defaults,
                tags=("deepspeed", "ulysses", "transformers", "framework", *case_fields.pop("tags", ())), **case_fields)


__all__ = ["MODEL_TYPES", "TINY_LLAMA", "CausalLMLogits", "hf_ulysses_case"]
