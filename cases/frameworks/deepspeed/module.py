"""Stage: step. DeepSpeed-Ulysses on the user's own `torch.nn.Module`: the user's model, whose
attention goes through DeepSpeed's `DistributedAttention`, sequence-sharded over the rank's SP
group and checked against the same model unsharded; grads by DeepSpeed's engine (ZeRO 0/1/2).

    from sp_harness.cases.frameworks.deepspeed.module import ulysses_module_case
    OWN = ulysses_module_case("my-ds-own", MyLM)      # MyLM(cfg, attention) -> nn.Module

What the user supplies:
- `build_model(cfg, attention) -> nn.Module`: their model, its shapes read from the config's GPT
  knobs (`cfg.vocab`, `cfg.hidden`, `cfg.num_heads`, `cfg.num_kv_heads`, `cfg.seq_len`, ...), each
  attention made as `attention(local_attention_module)` and called as DeepSpeed's
  `DistributedAttention` is: `attn(q, k, v, batch_dim_idx)` with q (B, s, a, d), k and v
  (B, s, a_kv, d) for batch_dim_idx 0 ([s, B, ...] for 1). The local module sees every token and
  this rank's heads. The factory runs once per process with the config's seed set (global RNG
  restored afterwards); the reference is it in float64.
- its inputs: by default `tokens` and `positions` (B, S) (the global position of every token:
  a rank holds `seq_len / sp` consecutive tokens, so positional encodings must come from them),
  each cut on dim 1; the model returns logits (B, s, V) judged against the next tokens with the
  token cross entropy. `make_batch`, `input_layouts`, `loss_sum` / `tokens` replace those.
- its params: every param replicated on every rank (Ulysses shards activations, not weights),
  unless `params(sharded_module, ctx)` maps local names to `ParamSpec`s for those it splits.

`attention(...)` returns a `SequenceParallelAttention` (deepspeed_model): the local module alone
in the reference; on a rank `DistributedAttention(local, ctx.tp_group, scatter_idx, gather_idx,
num_kv_heads)`, DeepSpeed's own class. Grad sync, ZeRO and float64: `deepspeed_ulysses.grad_sync_of`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from sp_harness import Batch, Case, Layout, ParamSpec, RankContext, Sharded
from sp_harness.cases.common import GPT_DEFAULTS, gpt_batch, gpt_tokens, with_positions
from sp_harness.cases.frameworks.deepspeed.case import check_engine_args, grad_sync_of, release_limits, ulysses_limits
from sp_harness.cases.frameworks.deepspeed.loss import case_loss_fields, loss_limits, sp_local_loss, token_batch
from sp_harness.cases.frameworks.deepspeed.model import SequenceParallelAttention
from sp_harness.cases.frameworks.deepspeed.runtime import (
    DEEPSPEED_PRELOAD,
    DEEPSPEED_VERSION,
    init_distributed,
    launcher_env,
    sp_groups,
)
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.reference.gpt import token_loss_sum

ModelFactory = Callable[[Any, Callable[[nn.Module], nn.Module]], nn.Module]
"""`build_model(cfg, attention) -> nn.Module`; `attention(local_module)` places one DistributedAttention."""


def ulysses_module_shard(*, grad_sync: str = "engine", mpu: bool = True, ds_config: Mapping[str, Any] | None = None,
                         input_layouts: Mapping[str, Layout] | None = None,
                         params: Callable[[nn.Module, RankContext], Mapping[str, ParamSpec]] | None = None,
                         loss: TokenLoss | None = None, normalise: str = "global"):
    """The sharded factory of a `ulysses_module_case`: every `SequenceParallelAttention` of the
    reference copy distributed over the rank's SP group, the model's grads synced by `grad_sync_of`;
    `loss`, `normalise`: each rank's share of the user's `TokenLoss` (`sp_local_loss`)."""
    local_loss = None if loss is None else sp_local_loss(loss, normalise)

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        from deepspeed.utils import groups

        launcher_env(ctx)
        groups.mpu = None  # a warm rank process starts each job as a new process does (ulysses_shard)
        ctx.once("deepspeed-init-distributed", init_distributed)
        ps = sp_groups(ctx)
        placed = [m for m in reference.modules() if isinstance(m, SequenceParallelAttention)]
        if not placed:
            raise ValueError("the model has no attention made by its factory's `attention(local_module)`: "
                             "nothing for DeepSpeed's DistributedAttention to shard")
        for m in placed:
            m.distribute(ctx.tp_group)
        sync = grad_sync_of(reference, ctx, grad_sync=grad_sync, mpu=ps if mpu else None, ds_config=ds_config)
        io = Layout(seq_dim=1, batch_dim=0)
        specs = dict(params(reference, ctx)) if params is not None else {}
        return Sharded(module=reference, input_layout=io, output_layout=io, input_layouts=dict(input_layouts or {}),
                       params=specs, replicated=("*",), sync_grads=sync, local_loss=local_loss)

    return shard


def ulysses_module_case(name: str, build_model: ModelFactory, *, scatter_idx: int = 2, gather_idx: int = 1,
                        num_kv_heads: int | None = None, grad_sync: str = "engine", mpu: bool = True,
                        ds_config: Mapping[str, Any] | None = None,
                        make_batch: Callable[[Any, int, torch.Generator], Batch] | None = None,
                        input_layouts: Mapping[str, Layout] | None = None,
                        params: Callable[[nn.Module, RankContext], Mapping[str, ParamSpec]] | None = None,
                        loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
                        tokens: Callable[[torch.Tensor], int] = gpt_tokens, loss: TokenLoss | None = None,
                        **case_fields: Any) -> Case:
    """A `Case` checking DeepSpeed's `DistributedAttention` inside the user's own model (see the
    module docstring for what `build_model` and the batch are). `scatter_idx`, `gather_idx`,
    `num_kv_heads`: DistributedAttention's (the defaults fit batch-first [B, s, a, d]; seq-first
    callers pass gather_idx=0 and batch_dim_idx 1). `grad_sync`, `mpu`, `ds_config`: as
    `ulysses_case`'s (engine with ZeRO 0/1/2 for float32 / bfloat16; "all-reduce" for float64).
    `loss`: your `TokenLoss` (labels, loss mask, padding, smoothing, loss function: deepspeed_loss),
    in place of `loss_sum` / `tokens`; the default batch is masked by it.
    `case_fields`: any other `Case` field (defaults, tags, isolation, examples, ...)."""
    if not callable(build_model):
        raise ValueError(f"ulysses_module_case({name!r}): build_model must be a callable (cfg, attention) -> "
                         f"nn.Module, got {build_model!r}")
    check_engine_args(name, grad_sync, ds_config)
    case_fields.setdefault("preload", DEEPSPEED_PRELOAD)

    def attention(local: nn.Module) -> nn.Module:
        if not isinstance(local, nn.Module):
            raise ValueError(f"attention(...) takes the local attention as an nn.Module (DistributedAttention "
                             f"wraps a module), got {type(local).__name__}")
        return SequenceParallelAttention(local, scatter_idx=scatter_idx, gather_idx=gather_idx,
                                         num_kv_heads=num_kv_heads)

    def build_reference(cfg) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = build_model(cfg, attention)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{name}: build_model returned {type(model).__name__}, not an nn.Module")
        return model.to(torch.float64)

    def default_batch(cfg, step, gen) -> Batch:
        return with_positions(*(gpt_batch(cfg, step, gen) if loss is None else token_batch(loss, cfg, step, gen)))

    def validate(cfg) -> None:
        ulysses_limits(cfg, grad_sync=grad_sync, ds_config=ds_config)
        release_limits(cfg, name, num_kv_heads=num_kv_heads, ds_config=ds_config)
        if loss is not None:
            loss_limits(cfg, loss)

    defaults = {**GPT_DEFAULTS, "dtype": "float32" if grad_sync == "engine" else "float64",
                **case_fields.pop("defaults", {})}
    model_name = getattr(build_model, "__name__", "a user model")
    return Case(name=name, description=f"DeepSpeed {DEEPSPEED_VERSION} DistributedAttention (Ulysses) in {model_name}, "
                                       f"grads by {grad_sync}",
                build_reference=build_reference, make_batch=make_batch or default_batch,
                shard=ulysses_module_shard(grad_sync=grad_sync, mpu=mpu, ds_config=ds_config,
                                           input_layouts=input_layouts, params=params, loss=loss),
                **({"loss_sum": loss_sum, "tokens": tokens} if loss is None else case_loss_fields(loss)),
                input_layout=Layout(seq_dim=1, batch_dim=0), validate=validate,
                defaults=defaults, tags=("deepspeed", "ulysses", "framework", *case_fields.pop("tags", ())),
                **case_fields)


__all__ = ["ModelFactory", "ulysses_module_case", "ulysses_module_shard"]
