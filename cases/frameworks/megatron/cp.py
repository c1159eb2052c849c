"""Stage: step. megatron-core's own context parallelism (`context_parallel_size` in a case's
`TransformerConfig` keywords) on CPU: megatron's CP code runs as it is, with an exact CPU
stand-in for TransformerEngine's CP attention in the core-attention slot of megatron's layer spec.

    from sp_harness.cases.frameworks.megatron import megatron_train_case
    GPT_CP = megatron_train_case("gpt-cp", dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                                                context_parallel_size=2, calculate_per_token_loss=True), tp=1)

What runs is megatron's (0.16.1), as Megatron-LM's `pretrain_gpt.py` runs it:
- `parallel_state.initialize_model_parallel(context_parallel_size=CP)` (runtime.parallel_state):
  its CP groups are the engine's sequence groups (the engine's "tp" group is the CP group here,
  megatron's TP is 1, as torchtitan's CP case has it); its DP x CP group is what its DDP reduces
  grads over and `finalize_model_grads` all-reduces the token count over;
- `get_batch_on_this_cp_rank` cuts the batch (`Sharded.prepare_inputs`): 2 x CP chunks of the
  sequence, CP rank r holds chunks r and 2CP-1-r (the causal load balancing); the labels and loss
  mask come cut by the same order (`cp_order`, the output's `Layout.seq_order`: the engine's cut
  of the target is the contract's statement, megatron's cut of the inputs its implementation, so a
  chunk order of megatron's that differs shows up as wrong logits);
- the GPTModel of its layer spec with `CPUContextParallelAttention` where the spec has
  `DotProductAttention` / `TEDotProductAttention`; RoPE's frequencies cut per CP rank by its
  `get_pos_emb_on_this_cp_rank` (runtime.cpu_shims 6: its index made on the CPU);
- its DDP, `finalize_model_grads`, and in the training step its schedule
  (`get_forward_backward_func`) with the per-token (`calculate_per_token_loss=True`) or legacy
  normalisation (megatron/step.py).

The stand-in (`CPUContextParallelAttention`):

What CUDA does. megatron's `TEDotProductAttention` hands TransformerEngine's `DotProductAttention`
the CP group (`cp_group`, `cp_global_ranks`, `cp_stream`, `cp_comm_type`, default "p2p"). TE's
`attn_forward_func_with_cp` then, for "p2p", passes K/V blocks round the CP ring (send/recv on
its own stream), runs one flash / fused-attention kernel per (local query chunk, K/V block) with
the causal mask each block pair needs under the load-balanced layout (full, lower-triangular or
skipped), merges the partial outputs by their log-sum-exps in float32, and in the backward passes
dK/dV round the ring back to their owners; for "all_gather", it all-gathers K/V over the CP
group, reorders them to sequence order, attends each local query chunk to the keys up to its own
position, and reduce-scatters dK/dV. Both are CUDA-only (TE's kernels, CUDA streams).

What the stand-in changes, and only that. It is megatron's own `DotProductAttention` (its
baddbmm, `FusedScaleMaskSoftmax`, dropout, bmm; the same parameters: a learnable softmax offset
keeps its name) run on this rank's queries against the whole sequence's keys and values: K and V
are all-gathered over the CP group by megatron's `gather_from_sequence_parallel_region` (forward
all-gather, backward reduce-scatter of dK/dV: TE's "all_gather" exchange), put back in sequence
order (inverting the load-balanced cut), and masked causally by global position (a query at
global position i sees keys j <= i), the mask megatron's softmax applies when it is handed one.
It is built with a copy of the config at CP 1, since `DotProductAttention` refuses CP itself.

Why the math is unchanged. Every query row attends to exactly the keys TE's per-block causal masks
give it (global positions up to its own), with the same scale and softmax; so each output row is
the same softmax(q k^T * scale) v and each key's and value's grad is the sum of its contributions
from every CP rank's queries, which TE's ring or reduce-scatter accumulates too. Only the rounding
differs: TE computes per block and merges by LSE, the stand-in takes each row's softmax at once
(in the run dtype, or float32 where `attention_softmax_in_fp32` asks), and a float64 run is exact.
TE's communication schedule ("p2p" ring vs all-gather) is not under test; "a2a" and "a2a+p2p"
(heads scattered over CP, hierarchical groups) are another layout and are refused.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sp_harness import Layout, ParamSpec, Sharded, Unsupported
from sp_harness.cases.frameworks.megatron.loss import PerTokenLosses, SmoothingStats, loss_func, per_token_losses
from sp_harness.cases.frameworks.token_loss import TokenLoss, valid

CP_KEYS = ("context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes")
"""The `TransformerConfig` keywords that shape context parallelism (the TP=1, CP=1 reference drops them)."""
CP_COMM_TYPES = (None, "p2p", "all_gather")
"""The `cp_comm_type`s whose K/V exchange the stand-in's all-gather is (the math of both: every
query against every key of the sequence); "a2a" and "a2a+p2p" scatter heads over CP instead."""


def cp_size(kwargs: Mapping[str, Any]) -> int:
    """The case's `context_parallel_size` (1 where unset); ValueError for a non-positive or non-int one."""
    cp = kwargs.get("context_parallel_size", 1)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context_parallel_size {cp!r}: a positive int (megatron's CP degree)")
    return cp


def cp_order(seq_len: int, seq_shards: tuple[int, ...]) -> Tensor:
    """`Layout.seq_order`: megatron's load-balanced CP layout (`get_batch_on_this_cp_rank`): the
    sequence as 2 x CP equal chunks, CP rank r holding chunks r and 2CP-1-r, in that order."""
    cp = len(seq_shards)
    chunk = seq_len // (2 * cp)
    chunks = torch.arange(seq_len).view(2 * cp, chunk)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def cp_limits(kwargs: Mapping[str, Any], cfg, *, tp: int | None, loss: TokenLoss) -> None:
    """Raises Unsupported where a CP case cannot be verified on this run (from the config alone,
    before any rank starts)."""
    cp = cp_size(kwargs)
    run = cfg.world_size // cfg.dp
    if tp not in (None, 1):
        raise Unsupported(f"context_parallel_size={cp} with tp={tp}: megatron CP x TP needs two sequence axes; "
                          f"the engine's mesh has one, so CP runs at megatron TP 1 (tp=1)")
    if run != cp:
        raise Unsupported(f"context_parallel_size={cp}: the run's sequence group is world_size / dp = {run} "
                          f"rank(s); run it at --world-size {cp} (or {2 * cp} --dp 2)")
    if kwargs.get("sequence_parallel"):
        raise Unsupported(f"context_parallel_size={cp} with sequence_parallel: megatron's sequence parallelism "
                          f"needs TP > 1, and CP runs at TP 1 here")
    if cfg.seq_shards is not None:
        raise Unsupported("megatron's CP cuts the sequence itself (get_batch_on_this_cp_rank): no explicit seq_shards")
    if cfg.seq_len % (2 * cp):
        raise Unsupported(f"megatron's CP needs seq_len ({cfg.seq_len}) divisible by 2 x CP ({2 * cp}): "
                          f"get_batch_on_this_cp_rank cuts it into 2 x CP equal chunks")
    comm = kwargs.get("cp_comm_type")
    other = [t for t in (comm if isinstance(comm, list | tuple) else [comm]) if t not in CP_COMM_TYPES]  # per layer
    if other:
        raise Unsupported(f"cp_comm_type {other[0]!r}: TransformerEngine's all-to-all CP scatters heads over the CP "
                          f"group, a layout the CPU stand-in does not run; verified: {[t for t in CP_COMM_TYPES if t]} "
                          f"(and None)")
    if kwargs.get("hierarchical_context_parallel_sizes"):
        raise Unsupported("hierarchical_context_parallel_sizes: hierarchical CP groups (a2a+p2p) are not set up here")
    if kwargs.get("window_size") is not None:
        raise Unsupported(f"window_size {kwargs['window_size']} with CP: the CPU stand-in masks causally by global "
                          f"position only (a sliding window would not be applied)")
    coeff = kwargs.get("moe_aux_loss_coeff", 0.0) if kwargs.get("num_moe_experts") else 0.0
    if any(c for c in (coeff if isinstance(coeff, list | tuple) else [coeff])):
        raise Unsupported(f"moe_aux_loss_coeff {coeff} with CP: the load-balancing loss's backward is scaled by "
                          f"megatron's schedule per micro-batch (CP / K in the legacy normalisation, the local token "
                          f"count in the per-token one), which the TP=1 reference does not model; experts without "
                          f"the aux loss run under CP")
    if loss.padding:
        raise Unsupported(f"TokenLoss.padding {loss.padding} with CP: an attention mask over pad keys is not "
                          f"TransformerEngine's CP attention's (causal, sbhd: padding needs packed THD sequences)")


def _attention_class():
    """`CPUContextParallelAttention`, made on first use (it subclasses megatron's DotProductAttention,
    which this module must not import before a rank does)."""
    global _ATTENTION
    if _ATTENTION is None:
        _ATTENTION = _make_attention_class(exchange_kv=True)
    return _ATTENTION


_ATTENTION: Any = None
_LOCAL_KV: Any = None


def _local_kv_attention_class():
    """The stand-in without its K/V exchange (a mutant's): see `cp_kv_not_gathered`."""
    global _LOCAL_KV
    if _LOCAL_KV is None:
        _LOCAL_KV = _make_attention_class(exchange_kv=False)
    return _LOCAL_KV


def _make_attention_class(*, exchange_kv: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class CPUContextParallelAttention(DotProductAttention):
        """TransformerEngine's CP attention's stand-in (the module docstring): megatron's own
        DotProductAttention on the local queries against the CP group's whole K/V."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, **groups):
            # `groups`: the attention's process groups under the release's name for them
            # (pg_collection; model_comm_pgs in 0.14), handed on as they came
            local = copy.copy(config)
            local.context_parallel_size = 1  # DotProductAttention asserts CP 1; the CP is this class's
            super().__init__(local, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, **groups)
            given = [getattr(g, "cp", None) for g in groups.values() if g is not None]
            self.cp_group = next((g for g in given if g is not None), None) or ps.get_context_parallel_group()
            self.cp = config.context_parallel_size
            if dist.get_world_size(self.cp_group) != self.cp:
                raise RuntimeError(f"megatron's CP group has {dist.get_world_size(self.cp_group)} ranks, "
                                   f"context_parallel_size is {self.cp}")

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            if packed_seq_params is not None or attention_mask is not None:
                raise NotImplementedError("CPUContextParallelAttention: causal attention over [s, b, h] sequences only "
                                          "(no packed sequences, no attention mask: TE's sbhd CP)")
            sq = query.shape[0]
            rank = dist.get_rank(self.cp_group)
            order = cp_order(sq * self.cp, (sq,) * self.cp).to(query.device)
            positions = order.narrow(0, rank * sq, sq)  # this rank's queries' global positions
            if exchange_kv:
                # megatron's all-gather over the CP group (backward: dK / dV reduce-scattered), each
                # rank's chunks in rank order, then back in sequence order
                key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
                value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
                restore = torch.argsort(order)
                key, value = key.index_select(0, restore), value.index_select(0, restore)
                key_positions = torch.arange(sq * self.cp, device=query.device)
            else:
                key_positions = positions
            mask = None
            if (attn_mask_type or self.attn_mask_type) != AttnMaskType.no_mask:
                # True = masked (megatron's convention): keys after the query's global position
                mask = (key_positions[None, :] > positions[:, None])[None, None]
            return super().forward(query, key, value, mask, attn_mask_type, attention_bias, None)

    if not exchange_kv:
        CPUContextParallelAttention.__name__ = CPUContextParallelAttention.__qualname__ = "LocalKVAttention"
    return CPUContextParallelAttention


def cp_layer_spec(spec, cp: int, attention=None):
    """`spec` (a layer `ModuleSpec` or a block's `TransformerBlockSubmodules`) with the CPU
    stand-in in every core-attention slot that holds megatron's `DotProductAttention` or
    `TransformerEngine`'s; `attention`: another stand-in class (a mutant's). Unsupported where the
    spec has no core attention (CP would cut the sequence of a model with nothing CP-specific to
    run: not applied) or one of another class, whose CP contract is unknown here."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    standin = attention or _attention_class()
    found: list[str] = []

    def core(value: Any) -> Any:
        module = value.module if isinstance(value, ModuleSpec) else value
        if module is DotProductAttention or getattr(module, "__name__", "") == "TEDotProductAttention":
            found.append(module.__name__)
            return dataclasses.replace(value, module=standin) if isinstance(value, ModuleSpec) else standin
        raise Unsupported(f"context_parallel_size={cp}: the layer spec's core attention is "
                          f"{getattr(module, '__qualname__', module)!r}, not megatron's DotProductAttention or "
                          f"TEDotProductAttention, whose CP contract the CPU stand-in keeps")

    def walk(value: Any) -> Any:
        if isinstance(value, ModuleSpec):
            return dataclasses.replace(value, submodules=walk(value.submodules))
        if isinstance(value, list | tuple):
            return type(value)(walk(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {f.name: core(getattr(value, f.name)) if f.name == "core_attention" and getattr(value, f.name)
                       is not None else walk(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return dataclasses.replace(value, **changes)
        return value

    made = walk(spec)
    if not found:
        raise Unsupported(f"context_parallel_size={cp} on a layer spec without a core attention: megatron's CP "
                          f"would cut the sequence of a model with nothing context-parallel to run (CP not applied); "
                          f"the check needs a self-attention (DotProductAttention or TEDotProductAttention)")
    return made


def load_whole(model: nn.Module, reference: nn.Module, prefix: str = "module.") -> dict[str, ParamSpec]:
    """Each param of this rank's megatron model (TP 1: every param whole, replicated over the CP
    group) loaded from the reference's of the same name. A shape that differs is megatron
    sharding a param at TP 1, which nothing here maps: a ValueError naming it."""
    full = reference.state_dict()
    specs: dict[str, ParamSpec] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            ref = full[name]
            if tuple(ref.shape) != tuple(p.shape):
                raise ValueError(f"{name}: local {tuple(p.shape)} of the reference's {tuple(ref.shape)} at megatron "
                                 f"TP 1, where every param is whole")
            p.copy_(ref)
            specs[prefix + name] = ParamSpec(ref_name=name)
    return specs


class CPLoss:
    """A CP rank's `local_loss` (the side-by-side check) and the token count its
    `finalize_model_grads` is given: pretrain_gpt.py's loss function on this rank's chunks, the
    backward started where megatron's schedule starts it (one micro-batch): from the local sum
    (`calculate_per_token_loss=True`; finalize divides by the count it all-reduces over DP x CP)
    or from the local sum over the local count (legacy; DDP averages over DP x CP). Its value is
    this rank's share of the token mean over the global batch (what the training loop logs, the
    reports all-reduced over DP x CP), with the grad of megatron's backward value."""

    def __init__(self, loss: TokenLoss, *, per_token: bool, losses: PerTokenLosses):
        self.loss, self.per_token, self.losses = loss, per_token, losses
        self.num_tokens: Tensor | None = None

    def __call__(self, out: Tensor, tgt: Tensor, ctx) -> Tensor:
        from megatron.core import parallel_state as ps

        loss_mask = valid(self.loss, tgt)
        labels = torch.where(loss_mask, tgt, torch.zeros_like(tgt))
        # megatron's TP group (one rank), not the engine's sequence group, is the vocab's
        total, num_tokens, _ = loss_func(loss_mask, self.losses(out, labels, ps.get_tensor_model_parallel_group()))
        if self.per_token:
            # as ShardedLoss: a float64 loss gets the count as a float64 tensor (finalize's 1 / count)
            self.num_tokens = num_tokens.to(total.dtype) if total.dtype == torch.float64 else num_tokens
            backward = total
        else:
            self.num_tokens = None
            backward = total / torch.clamp(num_tokens, min=1)  # forward_step_calc_loss, K = 1
        count = num_tokens.to(total.dtype)
        dist.all_reduce(count, group=ps.get_data_parallel_group(with_context_parallel=True))
        share = total.detach() * ctx.dp / count
        return share + (backward - backward.detach())


def cp_batch(inputs: dict[str, Any], ctx) -> dict[str, Any]:
    """`Sharded.prepare_inputs`: megatron's `get_batch_on_this_cp_rank` on the whole batch, as
    pretrain_gpt.py's `get_batch` calls it (its two-element chunk index made on the CPU:
    runtime.cpu_index)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from sp_harness.cases.frameworks.megatron.compat import cp_batch_arguments
    from sp_harness.cases.frameworks.megatron.runtime import cpu_index

    with cpu_index():
        return get_batch_on_this_cp_rank(dict(inputs), **cp_batch_arguments())


def require_cp_attention(model: nn.Module, cp: int, standin) -> None:
    """Every core attention of the built model is the stand-in, and there is one: else CP would
    not run where the config says it does."""
    cores = {name: type(m).__name__ for name, m in model.named_modules() if name.endswith("core_attention")}
    other = {n: t for n, t in cores.items() if not isinstance(model.get_submodule(n), standin)}
    if not cores or other:
        raise Unsupported(f"context_parallel_size={cp}: the model's core attentions {other or cores or 'none'} are not "
                          f"the CP stand-in (CP not applied)")


def megatron_cp_shard(kwargs: Mapping[str, Any], *, edit_model: Callable[[nn.Module], None] | None = None,
                      vocab_parallel_loss: bool = True, grad_sync: str = "finalize_model_grads",
                      ddp_config: Callable[[Any], Mapping[str, Any]] | None = None,
                      gpt_kwargs: Mapping[str, Any] | None = None, layer_spec: Any = None,
                      edit_params: Callable[[nn.Module], None] | None = None, loss: TokenLoss = TokenLoss(),
                      model_loss: bool = False, smoothing: SmoothingStats = "megatron",
                      attention: Callable[[], type] | None = None):
    """`megatron_shard` at `context_parallel_size` > 1 (the module docstring): the same knobs;
    `attention()`: the stand-in class for the core-attention slot (None: `CPUContextParallelAttention`;
    a mutant's otherwise)."""
    from sp_harness.cases.frameworks.megatron.gpt import build_gpt, resolve_layer_spec, transformer_config
    from sp_harness.cases.frameworks.megatron.runtime import cpu_shims, parallel_state

    gpt_kwargs = dict(gpt_kwargs or {})
    losses = per_token_losses(loss, vocab_parallel_loss=vocab_parallel_loss, model_loss=model_loss,
                              smoothing=smoothing)
    cp = cp_size(kwargs)

    def shard(reference: nn.Module, ctx) -> Sharded:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        ctx.once("megatron-core-cpu-shims", cpu_shims)
        cfg = ctx.config
        if ctx.tp != cp:
            raise Unsupported(f"context_parallel_size={cp}: this run's sequence group has {ctx.tp} ranks")
        parallel_state(1, (ctx.rank,), cp=cp, cp_ranks=ctx.tp_ranks)
        tconfig = transformer_config(kwargs, cfg, tp=1, sequence_parallel=False, dtype=cfg.torch_dtype,
                                      initialize=True)
        standin = attention() if attention is not None else _attention_class()
        spec = cp_layer_spec(resolve_layer_spec(tconfig, layer_spec), cp, standin)
        gpt = build_gpt(tconfig, cfg, None, parallel_output=vocab_parallel_loss, gpt_kwargs=gpt_kwargs, layer_spec=spec)
        require_cp_attention(gpt, cp, standin)
        gpt._apply(lambda t: t.to(cfg.torch_dtype) if t.is_floating_point() else t)
        if edit_params is not None:
            edit_params(gpt)
        specs = load_whole(gpt, reference)
        if edit_model is not None:
            edit_model(gpt)
        ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(**(ddp_config(cfg) if ddp_config else {})),
                                      gpt)
        local_loss = CPLoss(loss, per_token=bool(kwargs.get("calculate_per_token_loss")), losses=losses)
        whole = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)  # megatron cuts the sequence itself
        out = Layout(seq_dim=1, batch_dim=0, seq_order=cp_order)

        def finalize() -> None:
            finalize_model_grads([ddp], num_tokens=local_loss.num_tokens)

        return Sharded(module=ddp, input_layout=whole, output_layout=out, params=specs, local_loss=local_loss,
                       grad_attr="main_grad", prepare_inputs=cp_batch,
                       sync_grads=finalize if grad_sync == "finalize_model_grads" else ddp.finish_grad_sync)

    return shard


def cp_kv_not_gathered() -> type:
    """`megatron_cp_shard(attention=)` for a mutant: the stand-in without its K/V exchange, each CP
    rank's queries attending to its own chunks only (causal by global position), as TE's
    attention does when its CP group was never set (megatron's TEDotProductAttention builds with
    `cp_group` None until `set_context_parallel_group` is called)."""
    return _local_kv_attention_class()


__all__ = ["CPLoss", "CP_COMM_TYPES", "CP_KEYS", "cp_batch", "cp_kv_not_gathered", "cp_layer_spec", "cp_limits",
           "cp_order", "cp_size", "load_whole", "megatron_cp_shard", "require_cp_attention"]
