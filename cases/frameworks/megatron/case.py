"""Stage: step. megatron-core as a system under test: a `TransformerConfig`
(sequence_parallel=True) turned into a `Case`, verified against the same GPTModel at TP=1.

    from sp_harness.cases.frameworks.megatron.case import megatron_case
    GPT_SP = megatron_case("gpt-sp", dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                                          sequence_parallel=True), tp=2)

- The reference is megatron-core's own `GPTModel` (local spec: no apex, no TransformerEngine) at
  tensor_model_parallel_size=1, sequence parallelism off, float64, built in the reference's rank
  context: its process groups are handed in explicitly (`pg_collection`, one-rank groups), so it
  touches no megatron global state.
- The sharded twin is the user's config at the run's TP, built after megatron's own
  `parallel_state.initialize_model_parallel` (its vocab-parallel cross entropy and DDP read the
  groups from there), wrapped in megatron's `DistributedDataParallel` (grads in `main_grad`), its
  grads finished by megatron's `finalize_model_grads` (the DP all-reduce, and the sum over TP of
  the grads of every param flagged `sequence_parallel`: the layer norms and the row-parallel
  biases). Params are mapped from megatron's own attributes (`tensor_model_parallel`,
  `partition_dim`, `partition_stride`: a SwiGLU's fused [gate; up] fc1 through `strided_index`);
  weights come from the reference's state.
- The user's model: any `TransformerConfig` the local spec runs on CPU (SwiGLU, RMSNorm, GQA, MoE
  with SequentialMLP experts), `GPTModel`'s own keywords (`gpt_kwargs`: RoPE, tied embeddings) and
  a layer spec of theirs (`layer_spec`), all given to both models; what megatron cannot run here
  (grouped-GEMM experts, expert parallelism, ...) is UNSUPPORTED from the config.
- The output is the vocab-parallel logits (`parallel_output=True`), judged piecewise; the loss is
  megatron's `vocab_parallel_cross_entropy`, which computes in float32 whatever the run dtype.
- CPU shims live in `megatron_runtime.cpu_shims` alone, applied only where CUDA is absent; megatron's
  process state for a rank (its parallel_state groups) is set up there too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from sp_harness import Batch, Case, Layout, ParamSpec, Sharded, Unsupported
from sp_harness.cases.common import gpt_memory_floor
from sp_harness.cases.frameworks.common import require_tp
from sp_harness.cases.frameworks.megatron.compat import gated_fc1_stride, initialise_sinks, reference_parallel_state
from sp_harness.cases.frameworks.megatron.cp import CP_KEYS, cp_limits, cp_size, megatron_cp_shard
from sp_harness.cases.frameworks.megatron.gpt import DROPOUTS, build_gpt, resolve_layer_spec, transformer_config
from sp_harness.cases.frameworks.megatron.loss import (
    ShardedLoss,
    SmoothingStats,
    check_loss,
    make_inputs,
    per_token_losses,
    reference_language_model_loss,
    reference_loss_sum,
)
from sp_harness.cases.frameworks.megatron.runtime import (
    cpu_shims,
    global_memory_buffer,
    one_rank_groups,
    parallel_state,
)
from sp_harness.cases.frameworks.releases import require
from sp_harness.cases.frameworks.token_loss import TokenLoss, valid_tokens
from sp_harness.step.params import checked_spec

MEGATRON_CORE_VERSION = "0.16.1"
"""The release this module is tested with (the `megatron` extra pins it; the supported range:
`compat.RELEASES`)."""
COMPAT = "sp_harness.cases.frameworks.megatron.compat"
"""This package's `compat` module, as `releases.require` names it."""

GPT_KWARGS = ("position_embedding_type", "rotary_percent", "rotary_base", "rope_scaling", "rope_scaling_factor",
              "share_embeddings_and_output_weights", "seq_len_interpolation_factor")
"""The `GPTModel` keywords a case may set (`gpt_kwargs`): the rest are the run's (sizes, the
parallel output, process groups, pipeline stages)."""
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
"""The position embeddings a case verifies: megatron's "mrope" takes 3-D multimodal position ids
the batch does not have, "yarn" needs MLA's config class."""


def _check_gpt_kwargs(name: str, gpt_kwargs: Mapping[str, Any]) -> None:
    unknown = sorted(set(gpt_kwargs) - set(GPT_KWARGS))
    if unknown:
        raise ValueError(f"megatron_case({name!r}): gpt_kwargs {unknown} are not GPTModel keywords a case sets; "
                         f"valid: {list(GPT_KWARGS)} (sizes and groups come from the run)")
    kind = gpt_kwargs.get("position_embedding_type", "learned_absolute")
    if kind not in POSITION_EMBEDDINGS:
        raise ValueError(f"megatron_case({name!r}): position_embedding_type {kind!r}; valid: {list(POSITION_EMBEDDINGS)}")


def strided_index(dim: int, stride: int, tp: int, tp_rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """megatron's strided TP split (`partition_stride`, a gated MLP's fused [gate; up] fc1) as a
    `ParamSpec.index`: the reference's `dim` is `stride` equal blocks, each chunked over TP, and
    rank r holds chunk r of every block in block order (`_initialize_affine_weight_cpu`'s
    `weight_list[rank::world_size]`). The view has the blocks as a dim of their own."""

    def index(full: torch.Tensor) -> torch.Tensor:
        blocks = full.unflatten(dim, (stride, full.shape[dim] // stride))
        chunk = blocks.shape[dim + 1] // tp
        return blocks.narrow(dim + 1, tp_rank * chunk, chunk)

    return index


UNFLAGGED = ("not flagged tensor-parallel: megatron treats it as replicated, its grad norm and clipping "
             "counting it on TP rank 0 alone (param_is_not_tensor_parallel_duplicate)")
"""What megatron does with a TP-sharded param that lacks `tensor_model_parallel` (a finding's words)."""


def shard_spec(name: str, p: torch.Tensor, whole: torch.Size, ctx) -> ParamSpec:
    """Where this rank's megatron param `name` lives in the TP=1 reference's (shape `whole`),
    from megatron's own attributes: `tensor_model_parallel` with `partition_dim` (a contiguous
    chunk) and `partition_stride` (a strided split: `strided_index`); unflagged, replicated.
    Metadata that contradicts the param's shape is read off the shape where the shape says it
    (an unflagged TP chunk: learnable attention sinks' `softmax_offset`, head-sharded, Megatron-LM
    #7452 finding 8), the contradiction kept as the spec's finding; one the shape cannot place is
    a `ParamMappingError` (sp_harness.step.params.checked_spec, the engine's own rule)."""
    stride = getattr(p, "partition_stride", 1)
    if not getattr(p, "tensor_model_parallel", False):
        return checked_spec(ParamSpec(ref_name=name), p.shape, whole, ctx, UNFLAGGED)
    dim: int = p.partition_dim  # type: ignore[attr-defined]  # megatron's own attribute
    if stride != 1:
        spec = ParamSpec(ref_name=name, index=strided_index(dim, stride, ctx.tp, ctx.tp_rank))
        return checked_spec(spec, p.shape, whole, ctx, f"flagged tensor-parallel on dim {dim}, partition_stride {stride}")
    return checked_spec(ParamSpec(ref_name=name, dim=dim), p.shape, whole, ctx,
                        f"flagged tensor-parallel on partition_dim {dim}")


def load_shard(model: nn.Module, reference: nn.Module, ctx, prefix: str = "module.") -> dict[str, ParamSpec]:
    """Each param of this rank's megatron `model` loaded from the TP=1 reference's and mapped by
    megatron's own attributes (`shard_spec`); `prefix`: the local names' wrapper (megatron's DDP:
    "module.")."""
    full = reference.state_dict()
    specs: dict[str, ParamSpec] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = specs[prefix + name] = shard_spec(name, p, full[name].shape, ctx)
            if spec.index is not None:
                p.copy_(spec.index(full[name]).reshape(p.shape))
            elif spec.dim is not None:
                p.copy_(full[name].chunk(ctx.tp, dim=spec.dim)[ctx.tp_rank])
            else:
                p.copy_(full[name])
    return specs


GradSync = Literal["finalize_model_grads", "ddp"]
"""How the sharded twin finishes its grads after backward: megatron's `finalize_model_grads`
(what megatron's training loop calls: DP all-reduce, then the TP sum of every param flagged
`sequence_parallel`), or its DDP's own `finish_grad_sync` alone (DP only: what a hand-written
training loop around megatron's DDP calls when it misses the SP step)."""


def megatron_shard(kwargs: Mapping[str, Any], *, edit_model: Callable[[nn.Module], None] | None = None,
                   vocab_parallel_loss: bool = True, grad_sync: GradSync = "finalize_model_grads",
                   ddp_config: Callable[[Any], Mapping[str, Any]] | None = None,
                   gpt_kwargs: Mapping[str, Any] | None = None, layer_spec: Any = None,
                   edit_params: Callable[[nn.Module], None] | None = None, loss: TokenLoss = TokenLoss(),
                   model_loss: bool = False, smoothing: SmoothingStats = "megatron"):
    """The sharded factory of a `megatron_case`. `edit_model(gpt)` runs on this rank's megatron
    model before it is wrapped in megatron's DDP: a user's own change to it (a mutant's). The
    shapes in `kwargs` are overridden by the run's config (a `megatron_case`'s defaults).
    `vocab_parallel_loss`: the vocab-parallel logits and megatron's vocab-parallel cross entropy
    (a float32 island); False: logits gathered over TP by megatron (`parallel_output=False`) and
    the case's own loss in the run dtype. `grad_sync`: see `GradSync`. `ddp_config(run config)`:
    keywords of megatron's `DistributedDataParallelConfig` (None: its defaults), a function of the
    run (a bfloat16 run's training loop reduces grads in float32). `gpt_kwargs`, `layer_spec`: as
    `megatron_case`'s. `edit_params(gpt)` runs before the params are mapped and loaded: a change
    to the param attributes megatron's checkpoint loading reads (`partition_dim`,
    `partition_stride`), a mutant's. `loss`, `model_loss`, `smoothing`: as `megatron_case`'s.
    At `context_parallel_size` > 1 it is `megatron/cp.py`'s `megatron_cp_shard` (megatron TP 1,
    its CP over the engine's sequence group)."""
    gpt_kwargs = dict(gpt_kwargs or {})
    check_loss("megatron_shard", loss, vocab_parallel_loss=vocab_parallel_loss, model_loss=model_loss,
               smoothing=smoothing)
    if grad_sync not in ("finalize_model_grads", "ddp"):
        raise ValueError(f"grad_sync {grad_sync!r}: 'finalize_model_grads' or 'ddp'")
    if cp_size(kwargs) > 1:
        return megatron_cp_shard(kwargs, edit_model=edit_model, vocab_parallel_loss=vocab_parallel_loss,
                                 grad_sync=grad_sync, ddp_config=ddp_config, gpt_kwargs=gpt_kwargs,
                                 layer_spec=layer_spec, edit_params=edit_params, loss=loss, model_loss=model_loss,
                                 smoothing=smoothing)
    losses = per_token_losses(loss, vocab_parallel_loss=vocab_parallel_loss, model_loss=model_loss,
                              smoothing=smoothing)

    def shard(reference: nn.Module, ctx) -> Sharded:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        ctx.once("megatron-core-cpu-shims", cpu_shims)
        cfg = ctx.config
        parallel_state(ctx.tp, ctx.tp_ranks)
        tconfig = transformer_config(kwargs, cfg, tp=ctx.tp, sequence_parallel=kwargs.get("sequence_parallel", False),
                                      dtype=cfg.torch_dtype, initialize=True)
        gpt = build_gpt(tconfig, cfg, None, parallel_output=vocab_parallel_loss,  # None: megatron's parallel_state groups
                   gpt_kwargs=gpt_kwargs, layer_spec=layer_spec)
        # its torch norms and position embedding are made in the default dtype, not params_dtype
        # (megatron casts half models with Float16Module); the run dtype for every floating tensor
        gpt._apply(lambda t: t.to(cfg.torch_dtype) if t.is_floating_point() else t)
        gated_fc1_stride(gpt)  # 0.15's gated fc1 says its layout in its checkpoint code alone
        if edit_params is not None:
            edit_params(gpt)
        specs = load_shard(gpt, reference, ctx)
        if edit_model is not None:
            edit_model(gpt)
        ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(**(ddp_config(cfg) if ddp_config else {})),
                                      gpt)

        # the whole loss of this replica on every TP rank, reduced by pretrain_gpt's loss function
        # shape; with calculate_per_token_loss megatron's DDP sums grads over DP and
        # finalize_model_grads divides them by the token count all-reduced over DP
        local_loss = ShardedLoss(loss, per_token=bool(kwargs.get("calculate_per_token_loss")), losses=losses)
        io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)  # megatron scatters the sequence itself
        split = -1 if vocab_parallel_loss and not model_loss else None  # model_loss: per-token losses [b, s]
        out = Layout(seq_dim=1, batch_dim=0, seq_sharded=False, split_dim=split)

        def finalize() -> None:
            finalize_model_grads([ddp], num_tokens=local_loss.num_tokens)

        return Sharded(module=ddp, input_layout=io, output_layout=out, params=specs,
                       local_loss=local_loss, grad_attr="main_grad",
                       sync_grads=finalize if grad_sync == "finalize_model_grads" else ddp.finish_grad_sync)

    return shard


NOT_APPLIED: Mapping[str, Any] = {
    "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
    "hybrid_context_parallel": False, "max_seqlen_per_dp_cp_rank": None, "moe_extended_tp": False}
"""`TransformerConfig` keywords (with the only value this integration applies) that megatron
would accept and this integration would not apply: its parallel_state is set up at pipeline
parallel 1, static CP, no extended expert TP. Any other value is UNSUPPORTED, never a run that
silently leaves the knob out."""


def not_applied(kwargs: Mapping[str, Any]) -> None:
    """Unsupported naming the first keyword of `NOT_APPLIED` set to a value this integration
    would not apply."""
    for key, applied in NOT_APPLIED.items():
        if key in kwargs and kwargs[key] != applied:
            raise Unsupported(f"{key}={kwargs[key]!r}: not applied by this integration (megatron's groups are set up "
                              f"with {key}={applied!r}), so the check would run without it")


def _moe_supported(kwargs: Mapping[str, Any], tp: int, dp: int) -> None:
    """The MoE configs this integration verifies on CPU: megatron's local spec (SequentialMLP
    experts, one local MLP per expert) at expert parallel 1, experts TP-sharded as the dense MLP
    is; decided from the config, before any rank starts."""
    if not kwargs.get("num_moe_experts"):
        return
    if kwargs.get("expert_model_parallel_size", 1) != 1:
        raise Unsupported("expert parallelism > 1: megatron's groups are set up at expert parallel 1 here "
                          "(experts sharded over TP, SequentialMLP)")
    if kwargs.get("moe_grouped_gemm"):
        raise Unsupported("moe_grouped_gemm: megatron's grouped experts need TransformerEngine or the grouped_gemm "
                          "CUDA package, not on CPU")
    if kwargs.get("moe_token_dispatcher_type") == "flex":
        raise Unsupported("moe_token_dispatcher_type 'flex': DeepEP / HybridEP CUDA kernels, not on CPU")
    coeff = kwargs.get("moe_aux_loss_coeff", 0.0)
    if dp > 1 and any(c for c in (coeff if isinstance(coeff, (list, tuple)) else [coeff])):
        raise Unsupported(f"moe_aux_loss_coeff {coeff} at DP {dp}: megatron's load-balancing loss is a function of "
                          "each DP replica's tokens (counts reduced over TP x CP only), a different loss from the "
                          "TP=1 reference's over the global batch")
    etp = kwargs.get("expert_tensor_parallel_size")
    if etp is not None and etp != tp:
        raise Unsupported(f"expert_tensor_parallel_size {etp}: megatron's groups are set up with the experts "
                          f"sharded over the TP group here (expert TP = TP = {tp})")
    if kwargs.get("add_bias_linear", True) and tp != 1:
        raise Unsupported(f"MoE with add_bias_linear at expert TP {tp}: megatron supports expert biases only at "
                          "expert_tensor_parallel_size 1 (TransformerConfig asserts it); set add_bias_linear=False")


MEGATRON_PRELOAD = ("megatron.core.models.gpt", "megatron.core.tensor_parallel")
"""A megatron case's `Case.preload`: its modules imported before any job's clock (once by the fork
server on CPU: about 2.7 s a process)."""


def megatron_case(name: str, transformer_config_kwargs: Mapping[str, Any], *, tp: int | None = None,
                  seq_len: int = 16, vocab: int = 64, batch: int = 2,
                  edit_model: Callable[[nn.Module], None] | None = None, vocab_parallel_loss: bool = True,
                  gpt_kwargs: Mapping[str, Any] | None = None, layer_spec: Any = None, loss: TokenLoss = TokenLoss(),
                  model_loss: bool = False, smoothing: SmoothingStats = "megatron", **case_fields: Any) -> Case:
    """A `Case` checking megatron-core's GPTModel built from `transformer_config_kwargs` (a
    `TransformerConfig`'s keywords: num_layers, hidden_size, num_attention_heads, ffn_hidden_size,
    sequence_parallel, normalization, ...) at TP `tp` (None: whatever TP the run has) against the
    same model at TP=1. The shapes become the case's defaults (`--hidden`, `--seq-len`, `--vocab`
    override them). `gpt_kwargs`: `GPTModel`'s own keywords (`GPT_KWARGS`: RoPE, tied embeddings,
    ...), given to both models. `layer_spec`: a `ModuleSpec`, or a function of the
    `TransformerConfig` returning one (None: megatron's local spec for the config, experts
    included), used by both models. `edit_model`, `vocab_parallel_loss`: as `megatron_shard`'s.
    `loss`: the user's loss and batch (`TokenLoss`: a loss mask, label smoothing in megatron's
    convention, trailing padding under an attention mask, a loss function of theirs on gathered
    logits), reduced as pretrain_gpt.py reduces it and normalised as `calculate_per_token_loss`
    says (megatron/loss.py). `model_loss`: the GPTModel is called with `labels` and returns its
    own per-token losses (pretrain_gpt's forward step). `smoothing`: see `SmoothingStats`.
    `case_fields`: any other `Case` field (defaults, tags, ...)."""
    kwargs = dict(transformer_config_kwargs)
    gpt_kwargs = dict(gpt_kwargs or {})
    _check_gpt_kwargs(name, gpt_kwargs)
    check_loss(name, loss, vocab_parallel_loss=vocab_parallel_loss, model_loss=model_loss, smoothing=smoothing)
    # megatron-core's import (tens of seconds on a busy core) is setup, not the job's time
    case_fields.setdefault("preload", MEGATRON_PRELOAD)
    for key in ("tensor_model_parallel_size", "params_dtype"):
        if key in kwargs:
            raise ValueError(f"megatron_case({name!r}): {key} comes from the run (tp= and --dtype), not the kwargs")
    cp = cp_size(kwargs)
    hidden = kwargs.get("hidden_size", 32)
    shapes = dict(num_layers=kwargs.get("num_layers", 2), hidden=hidden, num_heads=kwargs.get("num_attention_heads", 4),
                  ffn=kwargs.get("ffn_hidden_size") or 4 * hidden)

    def validate(cfg):
        # the installed release: in range, its APIs there (a child interpreter asks, once a process)
        require(COMPAT, name)
        not_applied(kwargs)
        if cp > 1:
            cp_limits(kwargs, cfg, tp=tp, loss=loss)
        run_tp = 1 if cp > 1 else require_tp(cfg, tp, name, "megatron-core")
        if cfg.seq_shards is not None:
            raise Unsupported("megatron-core's sequence parallelism splits the sequence evenly; no explicit seq_shards")
        for what, n in (("seq_len", cfg.seq_len), ("vocab", cfg.vocab), ("num_attention_heads", cfg.num_heads),
                        ("ffn_hidden_size", cfg.ffn)):
            if n % run_tp:
                raise Unsupported(f"megatron-core needs {what} ({n}) divisible by TP ({run_tp})")
        groups = kwargs.get("num_query_groups")
        if groups is not None and (cfg.num_heads % groups or groups % run_tp):
            raise Unsupported(f"megatron-core needs num_query_groups ({groups}) dividing num_attention_heads "
                              f"({cfg.num_heads}) and divisible by TP ({run_tp})")
        _moe_supported(kwargs, run_tp, cfg.dp)
        if loss.padding >= cfg.seq_len:
            raise ValueError(f"TokenLoss.padding {loss.padding} leaves no position of a {cfg.seq_len}-token sequence")
        wet = {d: kwargs[d] for d in DROPOUTS if kwargs.get(d)}
        if wet:
            raise Unsupported(f"dropout {wet}: each rank draws its own masks, which no reference reproduces; set 0")

    def build_reference(cfg, ctx):
        ctx.once("megatron-core-cpu-shims", cpu_shims)
        reference_parallel_state()  # a one-rank reference process, where the release asks for it (0.15)
        global_memory_buffer()
        torch.manual_seed(cfg.seed)
        # the reference runs the whole sequence on one rank: no CP (its keywords dropped)
        tconfig = transformer_config({k: v for k, v in kwargs.items() if k not in CP_KEYS}, cfg, tp=1,
                                      sequence_parallel=False, dtype=torch.float64, initialize=True)
        gpt = build_gpt(tconfig, cfg, one_rank_groups(ctx.tp_group), parallel_output=True, gpt_kwargs=gpt_kwargs,
                   layer_spec=layer_spec)
        initialise_sinks(gpt)  # 0.15 leaves learnable attention sinks uninitialised (torch.empty)
        if model_loss:
            reference_language_model_loss(gpt)
        return gpt

    def make_batch(cfg, step, gen):
        rows = cfg.dp * cfg.batch
        tokens = torch.randint(0, cfg.vocab, (rows, cfg.seq_len), generator=gen)
        labels = torch.randint(0, cfg.vocab, (rows, cfg.seq_len), generator=gen)
        positions = torch.arange(cfg.seq_len).repeat(rows, 1)
        extra, target = make_inputs(loss, tokens, labels, gen, model_loss=model_loss)
        return Batch(inputs={"input_ids": tokens, "position_ids": positions, **extra}, target=target)

    defaults = {**shapes, "seq_len": seq_len, "vocab": vocab, "batch": batch, **case_fields.pop("defaults", {})}
    return Case(name=name, description=f"megatron-core {MEGATRON_CORE_VERSION} GPTModel, {kwargs}"
                + (f", {gpt_kwargs}" if gpt_kwargs else "") + ("" if loss.is_default else f", {loss.describe()}")
                + (", the GPTModel's own loss (labels)" if model_loss else ""),
                build_reference=build_reference, make_batch=make_batch, memory_floor=gpt_memory_floor, shard=megatron_shard(
                    kwargs, edit_model=edit_model, vocab_parallel_loss=vocab_parallel_loss, gpt_kwargs=gpt_kwargs,
                    layer_spec=layer_spec, loss=loss, model_loss=model_loss, smoothing=smoothing),
                loss_sum=reference_loss_sum(loss, vocab_parallel_loss=vocab_parallel_loss, model_loss=model_loss),
                tokens=lambda tgt: valid_tokens(loss, tgt), input_layout=Layout(seq_dim=1, batch_dim=0), validate=validate,
                defaults=defaults, tags=("megatron-core", "framework", *case_fields.pop("tags", ())), **case_fields)


def drop_sequence_parallel_flag(param_name: str) -> Callable[[nn.Module], None]:
    """An `edit_model` that removes megatron's `sequence_parallel` flag from one param: its TP
    grads are then never summed by `finalize_model_grads` (GPT-NeoX #1257's bug, through
    megatron's own knob)."""

    def edit(gpt: nn.Module) -> None:
        delattr(dict(gpt.named_parameters())[param_name], "sequence_parallel")

    return edit


def router_counts_over_dp_group() -> Callable[[nn.Module], None]:
    """An `edit_model` that hands every MoE router megatron's data-parallel group where it reduces
    its per-expert token counts over the TP x CP group (the sequence-parallel shards of the same
    tokens): the load-balancing loss then counts one shard's tokens as the whole batch's, and its
    grads are wrong (the token count reduced over the wrong group, Megatron-LM #7452's router
    finding)."""

    def edit(gpt: nn.Module) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import Router

        for module in gpt.modules():
            if isinstance(module, Router):
                module.tp_cp_group = ps.get_data_parallel_group()

    return edit


def partition_stride_one(param_name: str) -> Callable[[nn.Module], None]:
    """An `edit_params` that marks one param's TP split contiguous (`partition_stride` 1), as
    megatron's MLP does for a gated fc1 under `use_kitchen`: a fused [gate; up] weight is then
    loaded as contiguous TP chunks and each rank's local `chunk(2)` pairs gate rows with gate rows
    (Megatron-LM #360's SwiGLU at TP > 1)."""

    def edit(gpt: nn.Module) -> None:
        dict(gpt.named_parameters())[param_name].partition_stride = 1  # type: ignore[attr-defined]  # megatron's own attribute

    return edit


def flagged_attention_sinks(layer_spec: Any = None) -> Callable[[Any], Any]:
    """A `layer_spec` (a function of the `TransformerConfig`) whose core attention flags its
    learnable attention sinks tensor-parallel, as the fix does (NVIDIA/Megatron-LM PR #7530):
    `DotProductAttention` makes `softmax_offset` (one per local head, so head-sharded over TP),
    then `set_tensor_model_parallel_attributes(softmax_offset, True, 0, 1)`, so megatron's grad
    norm counts every TP rank's sinks. `layer_spec`: the spec whose core attention is replaced
    (None: megatron's local spec for the config)."""

    def spec(tconfig):
        import copy

        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class SinksFlaggedAttention(DotProductAttention):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                sinks = getattr(self, "softmax_offset", None)
                if isinstance(sinks, nn.Parameter) and not hasattr(sinks, "tensor_model_parallel"):
                    set_tensor_model_parallel_attributes(sinks, True, 0, 1)

        fixed = copy.deepcopy(resolve_layer_spec(tconfig, layer_spec))
        fixed.submodules.self_attention.submodules.core_attention = SinksFlaggedAttention
        return fixed

    return spec


__all__ = ["GPT_KWARGS", "MEGATRON_CORE_VERSION", "NOT_APPLIED", "POSITION_EMBEDDINGS", "GradSync",
           "drop_sequence_parallel_flag", "flagged_attention_sinks", "load_shard", "megatron_case", "megatron_shard", "not_applied", "partition_stride_one",
           "router_counts_over_dp_group", "strided_index"]
