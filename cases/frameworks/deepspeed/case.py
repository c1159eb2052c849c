"""Stage: step. DeepSpeed-Ulysses as a system under test: DeepSpeed's own
`deepspeed.sequence.layer.DistributedAttention` wrapped around a user's local attention inside a
small GPT, sequence-sharded over the rank's SP group, its grads reduced by DeepSpeed's engine.

    from sp_harness.cases.frameworks.deepspeed.case import sdpa_attention, ulysses_case
    DS_ULYSSES = ulysses_case("my-ds-ulysses", local_attention=sdpa_attention)

- The reference is the project's GPT (reference/gpt.py: embeddings, pre-norm blocks, MLP, LM
  head) whose attention calls the user's local attention on every head and the whole sequence:
  what `DistributedAttention` computes at SP=1, without DeepSpeed. Built float64.
- The sharded twin reuses the reference's modules (same parameter names, replicated weights);
  every activation outside attention holds this rank's `seq_len / sp` tokens. In each block the
  q/k/v projections of its tokens go through DeepSpeed's `DistributedAttention(local_attention,
  ctx.tp_group, scatter_idx, gather_idx)`: DeepSpeed's all-to-all sequence->heads, the user's
  attention on this rank's heads over the whole sequence, DeepSpeed's all-to-all back. Layout
  'bsh' hands DeepSpeed [b, s, h, d] (batch_dim_idx 0, gather_idx 1); layout 'sbh' [s, b, h, d]
  (batch_dim_idx 1, gather_idx 0: Megatron-DeepSpeed's layout and DeepSpeed's defaults).
- Grad sync is DeepSpeed's engine (`grad_sync="engine"`): `deepspeed.initialize(model, config
  (ZeRO stage 0), mpu=deepspeed.runtime.sequence_parallel.parallel_state_sp)` after DeepSpeed's
  own `initialize_sequence_parallel(sp)`; after backward, `engine.allreduce_gradients()` sums the
  grads over the SP group and averages them over DP (its `_reduce_non_expert_gradients`: the
  sequence-data-parallel group, divided by its size / sp). DeepSpeed's engine reduces only its
  accelerator's `supported_dtypes()` (float32, bfloat16, float16 where supported): at float64 it
  raises "attempting to reduce an unsupported grad type", so float64 runs are UNSUPPORTED with
  the engine and checked with `grad_sync="all-reduce"` (the same SUM over SP / mean over DP,
  written out, with DeepSpeed's mpu installed as the engine installs it).
- The local attention and the two models (the reference's attention through it; the sharded GPT
  with DistributedAttention in each block): `deepspeed_model`. DeepSpeed's process state (the
  per-process setup that JIT-builds its CPU comm op, `LOCAL_RANK`, its comm backend and SP
  groups): `deepspeed_runtime`. Its `UlyssesSPAttentionHF` on an HF Llama: `deepspeed_hf`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sp_harness import Batch, Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.common import (
    GPT_DEFAULTS,
    as_gpt,
    attention_of,
    gpt_batch,
    gpt_config,
    gpt_tokens,
    with_positions,
)
from sp_harness.cases.frameworks import releases
from sp_harness.cases.frameworks.deepspeed import compat
from sp_harness.cases.frameworks.deepspeed.loss import case_loss_fields, loss_limits, sp_local_loss, token_batch
from sp_harness.cases.frameworks.deepspeed.model import (
    DeepSpeedUlyssesAttention,
    LocalAttention,
    LocalAttentionFn,
    UlyssesGPT,
    UserAttention,
)
from sp_harness.cases.frameworks.deepspeed.runtime import (
    DEEPSPEED_PRELOAD,
    DEEPSPEED_VERSION,
    init_distributed,
    launcher_env,
    sp_groups,
)
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.reference.gpt import build_gpt, token_loss_sum


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """torch's scaled_dot_product_attention as a local attention: (B, S, a, d) -> (B, S, a, d)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def detached(fn: LocalAttentionFn) -> LocalAttentionFn:
    """`fn` on q, k, v detached from the graph: what DeepSpeed's all-to-all delivered under
    torch.compile before deepspeedai/DeepSpeed#8491 (the exchange's output carried no dependence
    on its input, so no grad reached the q/k/v projections; the forward is unchanged)."""

    def local(q, k, v, *, causal):
        return fn(q.detach(), k.detach(), v.detach(), causal=causal)

    return local



def _layout_indices(layout: str | None) -> tuple[int, int]:
    """(batch_dim_idx, the sequence dim DeepSpeed gathers) for the run's activation layout."""
    return (1, 0) if layout == "sbh" else (0, 1)


def _all_reduce_grads(module: nn.Module, ctx: RankContext) -> None:
    """The engine's stage-0 reduction written out (for float64, which the engine refuses): SUM
    over the SP x DP ranks, divided by DP."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dist.group.WORLD)
            p.grad.div_(ctx.dp)


def zero_stage(ds_config: Mapping[str, Any] | None) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 without `zero_optimization`)."""
    return int((ds_config or {}).get("zero_optimization", {}).get("stage", 0))


def _clear_zero_grads(optimizer: Any) -> None:
    """What DeepSpeed's ZeRO-1/2 optimizer drops when it skips a step (its overflow path in
    `DeepSpeedZeroOptimizer.step`): the bit16 params' grads, the flat grad partitions and the
    pre-flattened buffers, so the next backward starts from none, as after a real step."""
    optimizer.zero_grad(set_to_none=True)
    release = getattr(optimizer, "_release_preflattened_grad_buffers", None)
    if release is not None:
        release()
    for k in list(getattr(optimizer, "averaged_gradients", {})):
        optimizer.averaged_gradients[k] = None
        if k in getattr(optimizer, "all_grad_tensors", {}):
            optimizer.all_grad_tensors[k] = None


def grad_sync_of(model: nn.Module, ctx: RankContext, *, grad_sync: str, mpu: Any,
                 ds_config: Mapping[str, Any] | None) -> Callable[[], None]:
    """The grad sync of a Ulysses model: DeepSpeed's engine (`grad_sync="engine"`) or the
    engine's stage-0 sums written out ("all-reduce", with `mpu` installed where the engine
    installs it). ZeRO stage 0: `engine.allreduce_gradients()` leaves the summed grads in
    `.grad`. ZeRO 1/2 (`ds_config`'s `zero_optimization.stage`): the engine wraps an optimizer
    (ZeRO needs one; it is never stepped: the harness steps its own on the grads), reduces
    through its grad hooks and buckets during backward and `allreduce_gradients`, and keeps the
    result in its flat fp32 partitions; each param's grad is read back whole with DeepSpeed's
    `safe_get_full_grad` (the partition gathered over DP) and ZeRO's buffers are cleared for the
    next step, as its skipped step clears them."""
    from deepspeed.utils import groups

    cfg = ctx.config
    if grad_sync != "engine":
        groups.mpu = mpu  # as deepspeed.initialize installs it (the uneven-heads all-to-all reads it)
        return lambda: _all_reduce_grads(model, ctx)
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    stage = zero_stage(ds_config)
    config = {"train_micro_batch_size_per_gpu": cfg.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, **(ds_config or {})}
    params = [p for p in model.parameters() if p.requires_grad]
    # never stepped (the harness steps its own): ZeRO needs one to wrap, and before 0.19.x
    # `allreduce_gradients` tells the engine's optimizer the accumulation boundary unguarded, so
    # an engine without one cannot reduce; at stage 0 it is held unwrapped and the reduction is
    # the same `buffered_allreduce_fallback` either way
    optimizer = torch.optim.SGD(params, lr=0.0)
    if stage == 0:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
        return engine.allreduce_gradients
    # ZeRO keeps bfloat16 params with fp32 partitions only when told the run is bf16
    config.setdefault("bf16", {"enabled": cfg.torch_dtype == torch.bfloat16})
    config.setdefault("zero_allow_untested_optimizer", True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)

    def sync() -> None:
        engine.allreduce_gradients()
        full = [(p, safe_get_full_grad(p)) for p in params]
        full = [(p, None if g is None else g.detach().to(p.dtype).clone()) for p, g in full]
        _clear_zero_grads(engine.optimizer)
        for p, g in full:
            p.grad = g

    return sync


def ulysses_shard(*, local_attention: LocalAttentionFn, scatter_idx: int = 2, gather_idx: int | None = None,
                  batch_dim_idx: int | None = None, grad_sync: str = "engine", mpu: bool = True,
                  ds_config: Mapping[str, Any] | None = None, num_kv_heads: int | None = None,
                  loss: TokenLoss | None = None, normalise: str = "global"):
    """The sharded factory of a `ulysses_case`. `scatter_idx`, `gather_idx`, `num_kv_heads` are
    DistributedAttention's (None: the layout's sequence dim; the k/v heads read off the key
    tensor); `batch_dim_idx` is what its forward is told (None: the layout's); `mpu`: hand
    DeepSpeed's `parallel_state_sp` to the engine (False: the engine knows no SP group);
    `ds_config` merges into the engine's config (ZeRO stage 0, 1 or 2: `grad_sync_of`). `loss`:
    the user's `TokenLoss`, each rank's share normalised as `normalise` says (`sp_local_loss`;
    None: the harness's token mean)."""
    local_loss = None if loss is None else sp_local_loss(loss, normalise)

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        from deepspeed.utils import groups

        cfg = ctx.config
        launcher_env(ctx)
        # a warm rank process starts each job with DeepSpeed's groups as a new process has them:
        # an engine made with mpu=None keeps the mpu a previous job's engine installed (it only
        # ever sets `groups.mpu` when given one), and the uneven-heads all-to-all reads it
        groups.mpu = None
        ctx.once("deepspeed-init-distributed", init_distributed)
        ps = sp_groups(ctx)
        layout_bdi, seq_dim = _layout_indices(cfg.layout)
        told_bdi = layout_bdi if batch_dim_idx is None else batch_dim_idx
        for block in as_gpt(reference).blocks:
            attn = block.attn
            assert isinstance(attn, UserAttention)  # build_reference's
            local = LocalAttention(local_attention, attn.causal, layout_bdi)
            dist_attn = compat.distributed_attention(local, ctx.tp_group, scatter_idx=scatter_idx,
                                                     gather_idx=seq_dim if gather_idx is None else gather_idx,
                                                     num_kv_heads=num_kv_heads)
            block.attn = DeepSpeedUlyssesAttention(attn, dist_attn, layout_bdi, told_bdi)
        model = UlyssesGPT(as_gpt(reference))
        sync = grad_sync_of(model, ctx, grad_sync=grad_sync, mpu=ps if mpu else None, ds_config=ds_config)
        io = Layout(seq_dim=1, batch_dim=0)
        return Sharded(module=model, input_layout=io, output_layout=io, input_layouts={"positions": io},
                       replicated=("*",), sync_grads=sync, local_loss=local_loss)

    return shard


def check_engine_args(name: str, grad_sync: str, ds_config: Mapping[str, Any] | None) -> None:
    """ValueError for a grad sync or DeepSpeed config that makes no sense, naming the value."""
    if grad_sync not in ("engine", "all-reduce"):
        raise ValueError(f"{name!r}: grad_sync must be 'engine' or 'all-reduce', got {grad_sync!r}")
    stage = zero_stage(ds_config)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{name!r}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage and grad_sync != "engine":
        raise ValueError(f"{name!r}: ZeRO stage {stage} is the engine's: it needs grad_sync='engine', "
                         f"got {grad_sync!r}")


ZERO3_UNSUPPORTED = (
    "ZeRO-3 in the side-by-side check: it partitions every param above stage3_param_persistence_threshold "
    "between forwards and averages grads over the whole sequence-data-parallel world on its default "
    "reduce_scatter path (1/sp of ZeRO 0/1/2's), while this check reads and steps whole params with its own "
    "optimizer; DeepSpeed's own ZeRO-3 step is checked by ds_step_case (--train-step)")
"""Why a ZeRO-3 config is UNSUPPORTED by the side-by-side Ulysses cases (decided from the config)."""


def ulysses_limits(cfg, *, grad_sync: str, ds_config: Mapping[str, Any] | None = None) -> None:
    """DeepSpeed-Ulysses' limits on a resolved config, as `Unsupported` with the numbers (or a
    ValueError for shapes that make no sense); the heads are the config's GPT knobs."""
    sp = cfg.world_size // cfg.dp
    a, a_kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    if cfg.hidden % a or a % a_kv:
        raise ValueError(f"num_heads({a}) must divide hidden({cfg.hidden}) and num_kv_heads({a_kv}) num_heads")
    if cfg.ring_degree not in (None, 1):
        raise Unsupported(f"DeepSpeed's DistributedAttention is pure Ulysses: ring_degree({cfg.ring_degree})")
    if cfg.load_balancer not in (None, "none"):
        raise Unsupported(f"DeepSpeed-Ulysses shards the sequence contiguously: load_balancer {cfg.load_balancer!r}")
    shards = tuple(cfg.seq_shards) if cfg.seq_shards is not None else None
    if cfg.seq_len % sp or (shards is not None and len(set(shards)) > 1):
        raise Unsupported(
            f"DeepSpeed's DistributedAttention exchanges equal all_to_all_single splits, so every rank "
            f"must hold seq_len / sp tokens: seq_len {cfg.seq_len}, sp {sp}"
            + (f", seq_shards {list(shards)}" if shards else "")
            + " (an uneven split silently corrupts the output: deepspeedai/DeepSpeed#7384)")
    if a_kv % sp and a_kv < sp:
        raise Unsupported(f"DeepSpeed: 'Number of key-value heads ({a_kv}) must be at least the sequence "
                          f"parallel size ({sp})' (deepspeed.sequence.layer._resolve_kv_heads)")
    engine_limits(cfg, grad_sync=grad_sync, ds_config=ds_config)


def zero_release_limits(name: str, ds_config: Mapping[str, Any] | None) -> None:
    """ZeRO-1/2 in a side-by-side case (torch's `loss.backward()`, ZeRO's grad hooks) where the
    installed release reduces only inside `engine.backward`, as `Unsupported` naming it."""
    if zero_stage(ds_config) in (1, 2) and compat.lacks(compat.ZERO_TORCH_BACKWARD):
        raise Unsupported(compat.unsupported_without(
            compat.ZERO_TORCH_BACKWARD, f"{name} (ZeRO-{zero_stage(ds_config)} in the side-by-side check, which "
                                        f"backpropagates with loss.backward(); its engine step: ds_step_case)"))


def release_limits(cfg, name: str, *, num_kv_heads: int | None, ds_config: Mapping[str, Any] | None = None) -> None:
    """What the installed DeepSpeed release cannot run, as `Unsupported` before any rank starts:
    out of `compat.RELEASES` or an API every case needs missing (`releases.require`);
    DistributedAttention's `num_kv_heads` where this config needs it and the release lacks it (an
    explicit count, or grouped-query heads its per-tensor split would tear:
    `compat.gqa_without_num_kv_heads`); ZeRO-1/2 under torch's `loss.backward()` where the release
    reduces only inside `engine.backward` (`compat.ZERO_TORCH_BACKWARD`)."""
    releases.require(compat.__name__, name)
    zero_release_limits(name, ds_config)
    sp = cfg.world_size // cfg.dp
    a, a_kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    if num_kv_heads is not None and compat.lacks(compat.NUM_KV_HEADS):
        raise Unsupported(compat.unsupported_without(compat.NUM_KV_HEADS, f"{name} (num_kv_heads={num_kv_heads})"))
    if sp > 1 and not compat.gqa_without_num_kv_heads(a, a_kv, sp) and compat.lacks(compat.NUM_KV_HEADS):
        raise Unsupported(compat.unsupported_without(
            compat.NUM_KV_HEADS, f"{name}'s grouped-query heads ({a} query, {a_kv} k/v over sp {sp}: without the "
                                 f"count each all-to-all splits its own tensor's heads, which tears a k/v group)"))


def engine_limits(cfg, *, grad_sync: str, ds_config: Mapping[str, Any] | None) -> None:
    """What DeepSpeed's engine cannot run in the side-by-side check, as `Unsupported`: float64
    through its reduction, ZeRO-3 (`ZERO3_UNSUPPORTED`)."""
    if grad_sync == "engine" and cfg.dtype == "float64":
        raise Unsupported("DeepSpeed's engine reduces grads only in its accelerator's supported_dtypes "
                          "(float32, bfloat16, float16): 'attempting to reduce an unsupported grad type: "
                          "torch.float64'; a float64 check needs grad_sync='all-reduce'")
    if zero_stage(ds_config) == 3:
        raise Unsupported(ZERO3_UNSUPPORTED)


def ulysses_case(name: str, *, local_attention: LocalAttentionFn = sdpa_attention, scatter_idx: int = 2,
                 gather_idx: int | None = None, batch_dim_idx: int | None = None, grad_sync: str = "engine",
                 mpu: bool = True, ds_config: Mapping[str, Any] | None = None, num_kv_heads: int | None = None,
                 loss: TokenLoss | None = None, **case_fields: Any) -> Case:
    """A `Case` checking DeepSpeed's `DistributedAttention` around `local_attention` (see
    `LocalAttentionFn`) in a small GPT, sequence-sharded over the run's SP group (every rank of a
    DP replica), against the same GPT with `local_attention` unsharded. The GPT's shapes are the
    case's defaults (--hidden, --num-heads, --num-kv-heads, --seq-len, ... override them).
    `grad_sync`: "engine" (DeepSpeed's engine, float32/bfloat16) or "all-reduce" (the same sums
    written out; float64 too). `ds_config`: DeepSpeed's config dict, merged into the engine's
    (ZeRO stage 0, 1 or 2; stage 3 is UNSUPPORTED: `ZERO3_UNSUPPORTED`). `loss`: your labels, loss
    mask, padding, label smoothing or loss function (`TokenLoss`; deepspeed_loss). Other knobs: as
    `ulysses_shard`'s. `case_fields`: any other `Case` field (defaults, tags, isolation, examples, ...)."""
    case_fields.setdefault("preload", DEEPSPEED_PRELOAD)
    check_engine_args(name, grad_sync, ds_config)

    def validate(cfg) -> None:
        ulysses_limits(cfg, grad_sync=grad_sync, ds_config=ds_config)
        release_limits(cfg, name, num_kv_heads=num_kv_heads, ds_config=ds_config)
        if loss is not None:
            loss_limits(cfg, loss)

    def build_reference(cfg) -> nn.Module:
        model = build_gpt(gpt_config(cfg), seed=cfg.seed)
        for block in model.blocks:
            block.attn = UserAttention(attention_of(block), local_attention)
        return model

    def make_batch(cfg, step, gen) -> Batch:
        return with_positions(*(gpt_batch(cfg, step, gen) if loss is None else token_batch(loss, cfg, step, gen)))

    defaults = {**GPT_DEFAULTS, "dtype": "float32" if grad_sync == "engine" else "float64",
                **case_fields.pop("defaults", {})}
    case_fields = {"loss_sum": token_loss_sum, "tokens": gpt_tokens,
                   **(case_loss_fields(loss) if loss is not None else {}), **case_fields}
    return Case(name=name, description=f"DeepSpeed {DEEPSPEED_VERSION} DistributedAttention (Ulysses) around "
                                       f"{getattr(local_attention, '__name__', 'a local attention')}, grads by {grad_sync}",
                build_reference=build_reference, make_batch=make_batch,
                shard=ulysses_shard(local_attention=local_attention, scatter_idx=scatter_idx, gather_idx=gather_idx,
                                    batch_dim_idx=batch_dim_idx, grad_sync=grad_sync, mpu=mpu, ds_config=ds_config,
                                    num_kv_heads=num_kv_heads, loss=loss),
                input_layout=Layout(seq_dim=1, batch_dim=0),
                validate=validate, defaults=defaults,
                tags=("deepspeed", "ulysses", "framework", *case_fields.pop("tags", ())), **case_fields)


__all__ = ["ZERO3_UNSUPPORTED", "check_engine_args", "engine_limits", "detached", "grad_sync_of", "release_limits",
           "sdpa_attention", "zero_release_limits", "ulysses_case", "ulysses_limits", "ulysses_shard", "zero_stage"]
