"""Stage: step. Any megatron-core `MegatronModule` built with an explicit `pg_collection` (an
attention, an MLP, a block of the user's), checked at the run's TP against the same module at
TP=1, in float64:

    from sp_harness.cases.frameworks.megatron.module import megatron_module_case
    ATTN = megatron_module_case("xattn", dict(num_layers=1, hidden_size=32, num_attention_heads=4),
                                build=lambda config, pg: MyAttention(config, pg_collection=pg),
                                inputs=("hidden_states", "key_value_states"))

- `build(config, pg_collection)` makes the module: the reference's with one-rank groups at TP=1,
  the sharded twin's with the harness's groups (`harness_groups`: its TP group, its DP group) at
  the run's TP. Params are loaded from the reference and mapped by megatron's own attributes.
- megatron's global `parallel_state` is initialised in the transposed rank order: at DP > 1 its
  TP groups are the harness's DP groups, a second TP layout, so a module (or a layer inside it)
  that reads megatron's global TP group instead of its `pg_collection` computes over the wrong
  ranks and FAILs (Megatron-LM #7452 finding 6: `CrossAttention` builds `linear_q` / `linear_kv`
  without its `tp_group`). At DP 1 the two layouts are the same ranks: run it at DP > 1.
- Inputs are [s, b, h] float tensors (`inputs` names them, each drawn at random), sequence-sharded
  over TP under `sequence_parallel` (megatron's layout) and whole otherwise; `constants` are
  other keywords given to both (an attention mask of None, say). The output is the module's
  output (megatron's layers return (output, bias): their sum, as the layer's bias-dropout-add at
  dropout 0); the loss is its sum against a fixed
  random projection, per token.
- Grads through megatron's `DistributedDataParallel` and `finalize_model_grads`, both given the
  explicit groups too (the TP sum of the params flagged `sequence_parallel`, the DP average).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness import Batch, Case, Layout, Sharded, Unsupported
from sp_harness.cases.frameworks.common import require_tp
from sp_harness.cases.frameworks.megatron.case import COMPAT, MEGATRON_CORE_VERSION, load_shard
from sp_harness.cases.frameworks.megatron.compat import gated_fc1_stride, reference_parallel_state
from sp_harness.cases.frameworks.megatron.gpt import transformer_config
from sp_harness.cases.frameworks.megatron.runtime import (
    TRANSPOSED_ORDER,
    cpu_shims,
    global_memory_buffer,
    global_tp_group,
    one_rank_groups,
    parallel_state,
)
from sp_harness.cases.frameworks.releases import require

ModuleBuilder = Callable[[Any, Any], nn.Module]
"""(TransformerConfig, ProcessGroupCollection) -> the user's `MegatronModule`."""


def harness_groups(ctx):
    """The harness's process groups as megatron's `ProcessGroupCollection`: TP its TP group, DP
    its DP group, every other dimension (CP, PP, EP, embeddings) a one-rank group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    # new_subgroups is a collective over the world: once per rank process and mesh, keyed alike on
    # every rank so that all of them make it or none does
    one = ctx.once(("megatron-one-rank-group", ctx.world_size, ctx.tp, ctx.dp),
                   lambda: dist.new_subgroups(group_size=1)[0])
    tp, dp = ctx.tp_group, ctx.dp_group
    return ProcessGroupCollection(tp=tp, cp=one, pp=one, mp=tp, embd=one, pos_embd=one, dp=dp, dp_cp=dp,
                                  intra_dp_cp=dp, tp_cp=tp, ep=one, expt_tp=tp, tp_ep=tp, tp_ep_pp=tp,
                                  tp_dp_cp=dist.group.WORLD, expt_dp=dp, intra_expt_dp=dp)


def transposed_tp_ranks(ctx) -> tuple[int, ...]:
    """This rank's TP group in megatron's transposed rank order (DP varies fastest)."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=ctx.tp, ep=1, dp=ctx.dp, pp=1, cp=1, order=TRANSPOSED_ORDER)
    return next(tuple(g) for g in gen.get_ranks("tp") if ctx.rank in g)


def first_output(module: nn.Module) -> nn.Module:
    """The module's forward returning one tensor: megatron's layers return (output, bias) with
    the bias left for the caller to add (skip_bias_add), which the transformer layer's
    bias-dropout-add does; at dropout 0 that is output + bias. An instance attribute, so module
    names and hooks are unchanged."""
    forward = module.forward

    @functools.wraps(forward)
    def first(*args, **kwargs):
        out = forward(*args, **kwargs)
        if not isinstance(out, tuple):
            return out
        return out[0] if len(out) < 2 or out[1] is None else out[0] + out[1]

    module.forward = first
    return module


def megatron_module_case(name: str, transformer_config_kwargs: Mapping[str, Any], *, build: ModuleBuilder,
                         inputs: tuple[str, ...] = ("hidden_states",), constants: Mapping[str, Any] | None = None,
                         tp: int | None = None, seq_len: int = 16, batch: int = 2,
                         edit_model: Callable[[nn.Module], None] | None = None, **case_fields: Any) -> Case:
    """A `Case` checking the `MegatronModule` `build(config, pg_collection)` makes from the
    `TransformerConfig` keywords at TP `tp` (None: the run's) against the same module at TP=1.
    `edit_model(module)`: a change to this rank's module after its params are loaded (a mutant's).
    `case_fields`: any other `Case` field."""
    kwargs = dict(transformer_config_kwargs)
    constants = dict(constants or {})
    sp = bool(kwargs.get("sequence_parallel"))
    hidden = kwargs.get("hidden_size", 32)
    shapes = dict(num_layers=kwargs.get("num_layers", 1), hidden=hidden, num_heads=kwargs.get("num_attention_heads", 4),
                  ffn=kwargs.get("ffn_hidden_size") or 4 * hidden)
    layout = Layout(seq_dim=0, batch_dim=1, seq_sharded=sp)  # megatron's [s, b, h]

    def validate(cfg) -> None:
        require(COMPAT, name)  # the installed release: in range, its APIs there
        run_tp = require_tp(cfg, tp, name, "megatron-core")
        if cfg.seq_shards is not None:
            raise Unsupported("megatron-core's sequence parallelism splits the sequence evenly; no explicit seq_shards")
        for what, n in (("seq_len", cfg.seq_len), ("num_attention_heads", cfg.num_heads), ("ffn_hidden_size", cfg.ffn)):
            if n % run_tp:
                raise Unsupported(f"megatron-core needs {what} ({n}) divisible by TP ({run_tp})")
        wet = {d: kwargs[d] for d in ("hidden_dropout", "attention_dropout") if kwargs.get(d)}
        if wet:
            raise Unsupported(f"dropout {wet}: each rank draws its own masks, which no reference reproduces; set 0")

    def build_reference(cfg, ctx):
        ctx.once("megatron-core-cpu-shims", cpu_shims)
        reference_parallel_state()  # a one-rank reference process, where the release asks for it (0.15)
        global_memory_buffer()
        torch.manual_seed(cfg.seed)
        tconfig = transformer_config(kwargs, cfg, tp=1, sequence_parallel=False, dtype=torch.float64, initialize=True)
        with global_tp_group(ctx.tp_group):  # the reference context's group: one rank
            return first_output(build(tconfig, one_rank_groups(ctx.tp_group)))

    def shard(reference: nn.Module, ctx) -> Sharded:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ctx.once("megatron-core-cpu-shims", cpu_shims)
        cfg = ctx.config
        parallel_state(ctx.tp, transposed_tp_ranks(ctx), order=TRANSPOSED_ORDER)
        groups = harness_groups(ctx)
        tconfig = transformer_config(kwargs, cfg, tp=ctx.tp, sequence_parallel=sp, dtype=cfg.torch_dtype,
                                      initialize=True)
        module = first_output(build(tconfig, groups))
        module._apply(lambda t: t.to(cfg.torch_dtype) if t.is_floating_point() else t)
        gated_fc1_stride(module)  # 0.15's gated fc1 says its layout in its checkpoint code alone
        specs = load_shard(module, reference, ctx)
        if edit_model is not None:
            edit_model(module)
        ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(), module, pg_collection=groups)
        return Sharded(module=ddp, input_layout=layout, output_layout=layout, params=specs, grad_attr="main_grad",
                       sync_grads=lambda: finalize_model_grads([ddp], pg_collection=groups))

    def make_batch(cfg, step, gen):
        drawn = {n: torch.randn(cfg.seq_len, cfg.dp * cfg.batch, cfg.hidden, generator=gen, dtype=torch.float64)
                 for n in inputs}
        target = torch.randn(cfg.seq_len, cfg.dp * cfg.batch, cfg.hidden, generator=gen, dtype=torch.float64)
        return Batch(inputs={**drawn, **constants}, target=target)

    case_fields.setdefault("preload", ("megatron.core.transformer",))
    defaults = {**shapes, "seq_len": seq_len, "batch": batch, **case_fields.pop("defaults", {})}
    return Case(name=name, description=f"megatron-core {MEGATRON_CORE_VERSION} module, {kwargs}",
                build_reference=build_reference, make_batch=make_batch, shard=shard, validate=validate,
                loss_sum=lambda out, tgt: (out * tgt).sum(), tokens=lambda tgt: tgt.shape[0] * tgt.shape[1],
                input_layout=Layout(seq_dim=0, batch_dim=1), defaults=defaults,
                tags=("megatron-core", "framework", *case_fields.pop("tags", ())), **case_fields)


def cross_attention(fixed: bool = True) -> ModuleBuilder:
    """A builder of megatron's `CrossAttention` (local spec: column-parallel `linear_q` and
    `linear_kv`, `DotProductAttention`, row-parallel `linear_proj`). megatron-core 0.16.1 builds
    `linear_q` and `linear_kv` without `tp_group`, so they take megatron's global TP group, not
    the module's `pg_collection.tp` (Megatron-LM #7452 finding 6); `fixed` rebuilds both with it,
    as the upstream fix passes the explicit group to both projections (PR #7190)."""

    def build(config, pg_collection) -> nn.Module:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        linear = ColumnParallelLinear
        if fixed:
            linear = functools.partial(ColumnParallelLinear, tp_group=pg_collection.tp)
        submodules = CrossAttentionSubmodules(linear_q=linear, linear_kv=linear, core_attention=DotProductAttention,
                                              linear_proj=RowParallelLinear)
        return CrossAttention(config, submodules, layer_number=1, pg_collection=pg_collection)

    return build


__all__ = ["ModuleBuilder", "cross_attention", "first_output", "harness_groups", "megatron_module_case",
           "transposed_tp_ranks"]
