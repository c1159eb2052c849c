"""Stage: step. torchtitan as a system under test: its llama3 model with its
own tensor + sequence parallel sharding config turned into a `Case`, verified against the same
model unsharded.

    from sp_harness.cases.frameworks.torchtitan.case import torchtitan_case
    LLAMA3_SP = torchtitan_case("llama3-sp", dict(dim=32, n_layers=2, n_heads=4, vocab_size=64), tp=2)

- The model is torchtitan 0.3.0's `Llama3Model`, its config built the way torchtitan builds its
  own flavors (`torchtitan.models.llama3._build_llama3_layers`, fused wqkv, complex RoPE, SwiGLU
  FFN, RMSNorm), with the shapes given.
- The reference is that model unsharded, float64, never parallelized.
- The sharded twin is the same model with torchtitan's own llama3 sharding config
  (`set_llama3_sharding_config(config, enable_sp=True)`: the plan that declares colwise
  wqkv/w1/w3, rowwise wo/w2 reduce-scattering to the sequence shard, sequence-parallel
  RMSNorms, the vocab-parallel embedding and the colwise lm_head), applied by torchtitan's own
  `Module.parallelize(parallel_dims)` on the DTensor backend (`spmd_backend="partial_dtensor"`:
  DTensor on the TP axis, which is torchtitan's TP + SP via DTensor). The `ParallelDims` holds
  one mesh, "tp", built on this rank's TP group (`DeviceMesh.from_group`); torchtitan's own
  `build_mesh` would make a mesh of the whole world on "cuda".
- DP x TP (`--dp`): torchtitan's own data parallelism, `apply_fsdp_to_decoder` (FSDP2), on the
  "dp" axis of the harness's 2-D ("dp", "tp") mesh, after the TP plan on its "tp" axis, as
  torchtitan's `parallelize_llama` orders them.
- Params are DTensors; the engine reads each one's placements (Shard(d) on TP: split on d;
  Replicate: whole on every TP rank, checked bit for bit). Grads over TP are DTensor's own
  (a Replicate norm weight used on a sequence shard gets its Partial grad all-reduced).
- The output is the lm_head's DTensor (Shard(-1) on TP: vocab-parallel logits), gathered by the
  engine; the loss is a plain cross entropy in the run dtype on both sides.
- Attention: torchtitan's `ScaledDotProductAttention` (causal) on the CPU; its llama3 flavors
  default to FlexAttention, whose compiled CPU kernel has no backward (`validate`).
- CPU shims live in `cpu_shims` alone: the triton-kernel module stand-in (where triton is absent)
  and FSDP2's SUM-only reductions (where the DP group is gloo).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sp_harness import Batch, Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.frameworks.common import require_tp
from sp_harness.cases.frameworks.releases import require
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.cases.frameworks.torchtitan.cp import cp_limits, titan_cp_shard
from sp_harness.cases.frameworks.torchtitan.flex import (
    document_positions,
    flex_limits,
    reference_documents,
    titan_documents,
    use_inductor_cache,
)
from sp_harness.cases.frameworks.torchtitan.loss import (
    case_loss_fields,
    check_loss,
    check_unsupported,
    titan_batch,
    titan_local_loss,
)
from sp_harness.cases.frameworks.torchtitan.models import MODELS, UNWIRED, RegistryModel, retie
from sp_harness.cases.frameworks.torchtitan.spmd import spmd_limits, spmd_types_shard

if TYPE_CHECKING:  # imported where its cases run (Case.setup): torchtitan may not be installed
    from torchtitan.protocols.module import Module as TitanModule

TORCHTITAN_VERSION = "0.3.0"
"""The release this module is tested with (the `torchtitan` extra pins it)."""
COMPAT = "sp_harness.cases.frameworks.torchtitan.compat"
"""The package's releases module (`RELEASES`, `missing()`): asked by each case's validate."""

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "multiple_of",
               "ffn_dim_multiplier", "rope_theta", "max_seq_len", "fuse_qkv", "norm_eps")


def cpu_shims(fsdp_model: nn.Module | None = None) -> None:
    """The CPU shims, all of them, each a no-op where it is not needed, idempotent. Without an
    argument (before torchtitan is first imported) the first; with the model torchtitan's
    `apply_fsdp_to_decoder` wrapped, the second.

    1. torchtitan's model package imports its MoE token dispatcher, which imports the triton
       kernels of its expert-parallel all-to-all (`minimal_async_ep.kernels`, `import triton` at
       module level); a CPU torch has no triton. That one module is replaced by a stand-in whose
       every kernel raises if called. A dense llama3 never calls them (no MoE, no expert
       parallelism), so what torchtitan computes is unchanged. Nothing else sees the stand-in:
       no fake `triton` module is installed, so torch's own triton probes still find none.
       Skipped where triton is importable (every CUDA install).
    2. FSDP2 on gloo: FSDP2 averages grads over DP inside its reduce-scatter
       (`ReduceOp.AVG` / `PREMUL_SUM(1/dp)`), which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM
       with Gloo"). Each FSDP module is told `set_force_sum_reduction_for_comms(True)`, FSDP2's
       own switch for backends with SUM reductions only: the same average, with the 1/dp
       applied by FSDP before/after a SUM reduce-scatter. Skipped where the DP group is not gloo.
    """
    if fsdp_model is not None:
        from torch.distributed.fsdp import FSDPModule

        for module in fsdp_model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                # fully_shard's mesh info is an FSDPMeshInfo (it has the shard group); torch types
                # the attribute as its base class, which has not
                shard_group = group.mesh_info.shard_process_group if group is not None else None  # type: ignore[attr-defined]
                if group is None or dist.get_backend(shard_group) == "gloo":
                    module.set_force_sum_reduction_for_comms(True)
        return
    if _KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    class _NoTritonKernels(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)

            def kernel(*args, **kwargs):
                raise RuntimeError(f"{_KERNELS}.{name}: a triton kernel (expert parallelism), and triton "
                                   "is not installed")

            return kernel

    sys.modules[_KERNELS] = _NoTritonKernels(_KERNELS)


def preload(package: str) -> tuple[str, ...]:
    """A torchtitan case's `Case.preload`: the shim, then the model's package and its sharding
    config, imported before any job's clock (once by the fork server on CPU: about 3 s a process
    on this project's machines)."""
    return (f"{__name__}:cpu_shims", package, f"{package}.sharding")


def llama3_config(shapes: Mapping[str, Any], *, enable_sp: bool = True, attn_backend: str = "sdpa",
                  edit_sharding: Callable[[Any], None] | None = None):
    """A torchtitan `Llama3Model.Config` of the given shapes, built as torchtitan builds its own
    flavors (`_debugmodel`), with torchtitan's llama3 sharding config set on it
    (`set_llama3_sharding_config`, what its trainer's `update_from_config` does).
    `attn_backend`: "sdpa" (torchtitan's causal `ScaledDotProductAttention`) or a backend
    torchtitan's `get_attention_config` knows ("flex", "varlen": GPU only).
    `edit_sharding(config)` runs after the sharding config is set: a user's own change to the
    plan (a mutant's)."""
    cpu_shims()
    from torchtitan.models import llama3 as L
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim, vocab = shapes["dim"], shapes["vocab_size"]
    n_heads = shapes["n_heads"]
    hidden = shapes.get("hidden_dim") or L.compute_ffn_hidden_dim(
        dim, multiple_of=shapes.get("multiple_of", 16), ffn_dim_multiplier=shapes.get("ffn_dim_multiplier"))
    eps = shapes.get("norm_eps", 1e-5)
    layers = L._build_llama3_layers(
        fuse_qkv=shapes.get("fuse_qkv", True), n_layers=shapes["n_layers"], dim=dim, n_heads=n_heads,
        n_kv_heads=shapes.get("n_kv_heads"), hidden_dim=hidden,
        rope=L.ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=shapes.get("max_seq_len", 256),
                                  theta=shapes.get("rope_theta", 500000), scaling="llama"),
        attn_backend="flex" if attn_backend == "sdpa" else attn_backend)
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
        if attn_backend == "sdpa":
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = L.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=L.Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=L.RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=L._NORM_INIT),
        lm_head=L.Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=layers)
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    if edit_sharding is not None:
        edit_sharding(config)
    return config


ModelName = str
"""A registry model's name: "llama3" or a key of torchtitan_models' `MODELS` ("qwen3", ...)."""


def registry_models() -> dict[str, RegistryModel]:
    """Every model a `torchtitan_case` builds, by its registry name."""
    return {"llama3": RegistryModel(keys=_SHAPE_KEYS, config=llama3_config, package="torchtitan.models.llama3"),
            **MODELS}


def model_config(model: ModelName, shapes: Mapping[str, Any], **kwargs: Any):
    """The torchtitan config of registry model `model` (`registry_models`) with its own sharding
    config set; `kwargs`: as `llama3_config`'s."""
    cpu_shims()
    return registry_models()[model].config(shapes, **kwargs)


def _parallel_dims(tp_group, tp: int, world_size: int):
    """torchtitan's `ParallelDims` for TP `tp` on the DTensor backend, its one mesh ("tp") built on
    this rank's TP group. `Module.parallelize` resolves every placement on the "tp" axis alone
    under this backend (DP and CP stay out of band), so no other mesh is needed."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=world_size // tp, cp=1, tp=tp, pp=1, ep=1, world_size=world_size,
                        spmd_backend="partial_dtensor")
    mesh = DeviceMesh.from_group(tp_group, "cpu" if not torch.cuda.is_available() else "cuda",
                                 mesh_dim_names=("tp",))
    dims._single_axis_meshes = {"tp": mesh, **_no_ep(mesh)}
    return dims


def _no_ep(like) -> dict:
    """The "ep" axis at degree 1, which torchtitan's MoE asks for (deepseek_v3's
    `RoutedExperts.parallelize`: `get_optional_mesh("ep")`, None at size 1): a one-rank mesh of
    this rank on `like`'s device type, with no process group, never used for a collective."""
    from torch.distributed.device_mesh import DeviceMesh

    return {"ep": DeviceMesh(like.device_type, [dist.get_rank()], mesh_dim_names=("ep",), _init_backend=False)}


def _parallelize_with_fsdp(model: TitanModule, ctx: RankContext, *, fsdp_mean: bool = True) -> None:
    """DP x TP: torchtitan's TP + SP plan on the "tp" axis, then its own data parallelism,
    `apply_fsdp_to_decoder` (FSDP2 `fully_shard` per block, the embedding, and norm + lm_head)
    on the "dp" axis of the same 2-D mesh (FSDP2 over TP DTensors needs one root mesh). Its mixed
    precision policy is set to the run dtype (params and reductions), so it casts nothing."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    mesh = ctx.device_mesh  # ("dp", "tp") over the harness's groups
    dims = ParallelDims(dp_replicate=1, dp_shard=ctx.dp, cp=1, tp=ctx.tp, pp=1, ep=1, world_size=ctx.world_size,
                        spmd_backend="partial_dtensor")
    dims._single_axis_meshes = {"tp": mesh["tp"], "fsdp": mesh["dp"], **_no_ep(mesh)}
    model.parallelize(dims)
    retie(model)
    dtype = ctx.config.torch_dtype
    apply_fsdp_to_decoder(model, mesh["dp"], param_dtype=dtype, reduce_dtype=dtype, pp_enabled=False)
    # apply_fsdp_to_decoder turns FSDP's grad division off (`disable_fsdp_gradient_division`):
    # torchtitan's trainer divides each replica's summed token loss by the global token count, so
    # the SUM over DP is the mean. The engine's replica loss is the replica's own mean, so FSDP's
    # divide factor goes back to the DP size: the same grads (every replica holds equal tokens).
    if fsdp_mean:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(ctx.dp))
    cpu_shims(model)


def _build(config: Any, dtype: torch.dtype) -> TitanModule:
    model = config.build()
    model.init_states()
    # floating tensors only: the complex64 RoPE cache keeps its dtype, as torchtitan keeps it
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def torchtitan_shard(shapes: Mapping[str, Any], *, enable_sp: bool = True, attn_backend: str = "sdpa",
                     edit_sharding: Callable[[Any], None] | None = None, fsdp_mean: bool = True,
                     model: ModelName = "llama3", loss: TokenLoss | None = None, count: str = "valid",
                     see_documents: bool = True):
    """The sharded factory of a `torchtitan_case`: this rank's llama3 built from the config
    (with `edit_sharding` applied to its sharding config), loaded with the reference's state
    and parallelized by torchtitan's `Module.parallelize` on this rank's TP group (and, at
    dp > 1, its `apply_fsdp_to_decoder`). `fsdp_mean=False` leaves FSDP's grad division as
    `apply_fsdp_to_decoder` sets it (off: grads summed over DP, for torchtitan's trainer, which
    divides the loss by the global token count). `loss`: the rank's loss as torchtitan computes it
    (torchtitan_loss: its vocab-parallel cross entropy on the `Shard(-1)` logits, or your
    `loss_fn` on the whole logits; `count` its divisor); None: a cross entropy on the gathered
    logits in the run dtype. `see_documents=False`: with attn_backend="flex", the masks built as if
    each row were one document (a mutant's)."""

    def shard(reference: nn.Module, ctx) -> Sharded:
        from torchtitan.distributed.utils import set_spmd_backend

        cfg = ctx.config
        set_spmd_backend("partial_dtensor")
        config = model_config(model, _run_shapes(shapes, cfg), enable_sp=enable_sp, attn_backend=attn_backend,
                              edit_sharding=edit_sharding)
        built = _build(config, cfg.torch_dtype)
        built.load_state_dict(reference.state_dict())
        if ctx.dp == 1:
            built.parallelize(_parallel_dims(ctx.tp_group, ctx.tp, ctx.tp))
            retie(built)
        else:
            _parallelize_with_fsdp(built, ctx, fsdp_mean=fsdp_mean)
        if attn_backend == "flex":
            titan_documents(built, see_documents=see_documents)
        io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)  # tokens whole on every TP rank; torchtitan cuts
        # a module the plan leaves alone keeps plain params, whole on every rank (as DTensor's
        # parallelize_module leaves them); every sharded one is a DTensor that maps itself
        if loss is None:
            return Sharded(module=built, input_layout=io, output_layout=io, replicated=("*",))
        if loss.loss_fn is not None:  # your loss on the whole logits (the engine gathers the DTensor)
            return Sharded(module=built, input_layout=io, output_layout=io, replicated=("*",),
                           local_loss=titan_local_loss(loss, count=count))
        return Sharded(module=built, input_layout=io, output_layout=Layout(seq_dim=1, batch_dim=0, seq_sharded=False,
                                                                           split_dim=-1),
                       replicated=("*",), local_loss=titan_local_loss(loss, vocab=_vocab(ctx), count=count,
                                                                      vocab_mesh=lambda: _tp_mesh(built)))

    return shard


def torchtitan_spmd_shard(shapes: Mapping[str, Any], *, enable_sp: bool = True, attn_backend: str = "sdpa",
                          edit_sharding: Callable[[Any], None] | None = None, model: ModelName = "llama3",
                          loss: TokenLoss | None = None, count: str = "valid"):
    """The sharded factory of a `torchtitan_case(..., spmd_backend="spmd_types")`: this rank's
    model from its config (`edit_sharding` applied), parallelized on torchtitan's spmd_types
    backend (torchtitan_spmd). `loss`, `count`: as `torchtitan_shard`'s."""
    return spmd_types_shard(
        lambda ctx: _build(model_config(model, _run_shapes(shapes, ctx.config), enable_sp=enable_sp,
                                        attn_backend=attn_backend, edit_sharding=edit_sharding), ctx.config.torch_dtype),
        _vocab, loss=loss, count=count)


def torchtitan_cp_shard(shapes: Mapping[str, Any], *, attn_backend: str = "sdpa", model: ModelName = "llama3",
                        shard_positions: bool = True, loss: TokenLoss | None = None, count: str = "valid",
                        fsdp_mean: bool = True):
    """The sharded factory of a `torchtitan_case(..., context_parallel=N)`: the model from its
    config under torchtitan's CP path (torchtitan_cp). `shard_positions=False`: RoPE positions
    not handed to the model (a mutant's). `loss`, `count`: as `torchtitan_shard`'s, on the CP
    rank's sequence shard over its replica's valid tokens (counted across CP). `fsdp_mean`: as
    `torchtitan_shard`'s, at DP x CP."""
    local_loss = None if loss is None else titan_local_loss(loss, seq_sharded=True, count=count)
    return titan_cp_shard(lambda ctx: _build(model_config(model, _run_shapes(shapes, ctx.config), attn_backend=attn_backend),
                                             ctx.config.torch_dtype), cpu_shims, shard_positions=shard_positions,
                          local_loss=local_loss, fsdp_mean=fsdp_mean)


def _unwired_case(name: str, model: str, wired: tuple[str, ...], case_fields: Mapping[str, Any]) -> Case:
    """A case of a registry model not wired here (torchtitan_models' `UNWIRED`): every run is
    UNSUPPORTED with the reason, before any rank starts; nothing else of it ever runs."""
    why = f"torchtitan's {model} is not wired here: {UNWIRED[model]} (wired: {', '.join(wired)})"

    def refuse(cfg) -> None:
        raise Unsupported(why)

    def never(*args: Any) -> Any:
        raise AssertionError(f"{name}: its validate refuses every run")  # our invariant: validate runs first

    return Case(name=name, description=f"torchtitan {TORCHTITAN_VERSION} {model} (not wired: UNSUPPORTED)",
                build_reference=never, make_batch=never, loss_sum=never, tokens=never, shard=never, validate=refuse,
                tags=("torchtitan", "framework", *case_fields.get("tags", ())))


def _tp_mesh(model: nn.Module):
    """The 1-D TP mesh of the model's vocab-parallel lm_head (its DTensor weight's mesh, the "tp"
    axis of it under DP x TP)."""
    weight: Any = model.get_submodule("lm_head").weight  # a DTensor
    mesh = weight.device_mesh
    return mesh["tp"] if mesh.ndim > 1 else mesh


def _vocab(ctx: RankContext) -> int:
    assert ctx.config.vocab is not None, "a resolved config has the case's vocab"
    return ctx.config.vocab


def _run_shapes(shapes: Mapping[str, Any], cfg) -> dict:
    """The case's shapes with the run's config on top (--hidden, --num-layers, --vocab, ...)."""
    return {**shapes, "dim": cfg.hidden, "n_layers": cfg.num_layers, "n_heads": cfg.num_heads,
            "n_kv_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab, "max_seq_len": max(cfg.seq_len, 2)}


SpmdBackend = Literal["partial_dtensor", "spmd_types"]

CP_STEP = ("torchtitan's context parallelism runs in the side-by-side check (torchtitan_case(..., context_parallel=2), "
           "torch's ring through the CPU shim cp_cpu_ring); under its trainer step (the CP cut in "
           "post_dataloading_process, the token count taken before it) it is not wired")
"""Why `titan_train_case(..., context_parallel > 1)` is Unsupported."""


def torchtitan_case(name: str, model_kwargs: Mapping[str, Any], *, tp: int | None = None,
                    enable_sp: bool = True, attn_backend: str = "sdpa", seq_len: int = 16, batch: int = 2,
                    edit_sharding: Callable[[Any], None] | None = None,
                    spmd_backend: SpmdBackend = "partial_dtensor", model: ModelName = "llama3",
                    context_parallel: int = 1, loss: TokenLoss | None = None, documents: int = 1,
                    **case_fields: Any) -> Case:
    """A `Case` checking torchtitan's llama3 of `model_kwargs` (dim, n_layers, n_heads,
    n_kv_heads, vocab_size, hidden_dim or multiple_of/ffn_dim_multiplier, rope_theta, fuse_qkv,
    norm_eps) under torchtitan's TP (+ SP where `enable_sp`) sharding config at TP `tp` (None:
    whatever TP the run has) against the same model unsharded. The shapes become the case's
    defaults (`--hidden`, `--num-heads`, `--vocab`, ... override them). `edit_sharding`: as
    `llama3_config`'s. `spmd_backend`: torchtitan's `parallelism.spmd_backend`, "partial_dtensor"
    (DTensor on TP) or "spmd_types" (plain local tensors with spmd types: torchtitan_spmd).
    `model`: the registry model, "llama3" or a key of torchtitan_models' `MODELS` ("qwen3", ...;
    `registry_models()`: each one's shape keys).
    `context_parallel`: torchtitan's CP degree (torchtitan_cp: its SDPA CP at TP 1, DP 1, float32 / bfloat16,
    torch's ring through the CPU shim cp_cpu_ring; what it cannot run is Unsupported, `cp_limits`).
    `documents`: with attn_backend="flex", the documents packed in each row, masked by torchtitan's
    own causal + packed-document BlockMask (torchtitan_flex: forward-only on CPU).
    `loss`: your labels' loss mask, trailing padding and your own per-token loss (`TokenLoss`;
    torchtitan_loss: torchtitan's own cross entropy on each rank, the reference's in float64).
    `case_fields`: any other `Case` field (defaults, tags, ...)."""
    if loss is not None:
        check_loss(name, loss)
    if documents < 1 or (documents > 1 and attn_backend != "flex"):
        raise ValueError(f"torchtitan_case({name!r}): documents {documents}; packed documents (>= 1) are masked by "
                         f"attn_backend='flex' only (SDPA takes no document mask: torchtitan's get_attention_config "
                         f"refuses it for packed language-model batches)")
    if spmd_backend not in ("partial_dtensor", "spmd_types"):
        raise ValueError(f"torchtitan_case({name!r}): spmd_backend {spmd_backend!r}; known: partial_dtensor, "
                         "spmd_types (full_dtensor: not wired)")
    if context_parallel < 1:
        raise ValueError(f"torchtitan_case({name!r}): context_parallel {context_parallel}; must be >= 1")
    models = registry_models()
    if model in UNWIRED:
        return _unwired_case(name, model, tuple(models), case_fields)
    if model not in models:
        raise ValueError(f"torchtitan_case({name!r}): model {model!r}; known: {', '.join((*models, *UNWIRED))}")
    keys = models[model].keys
    unknown = sorted(set(model_kwargs) - set(keys))
    if unknown:
        raise ValueError(f"torchtitan_case({name!r}): unknown {model} kwargs {unknown}; known: {list(keys)}")
    shapes = {"n_layers": 2, "n_heads": 4, "vocab_size": 64, "multiple_of": 16, **model_kwargs}
    shapes.setdefault("dim", 32)
    case_fields.setdefault("preload", preload(models[model].package))
    if attn_backend == "flex":  # inductor's kernel cache kept across rank pools
        case_fields.setdefault("setup", use_inductor_cache)
    defaults = dict(hidden=shapes["dim"], num_layers=shapes["n_layers"], num_heads=shapes["n_heads"],
                    num_kv_heads=shapes.get("n_kv_heads"), vocab=shapes["vocab_size"], seq_len=seq_len, batch=batch)

    def validate(cfg):
        require(COMPAT, name)  # the installed release: in range, its APIs there
        if context_parallel > 1 and torch.cuda.is_available():
            raise Unsupported("torchtitan's context parallelism on CUDA is not wired into this case (unverified here)")
        if context_parallel > 1 and (why := cp_limits(cfg, context_parallel, tp, spmd_backend, attn_backend)):
            raise Unsupported(why)
        run_tp = 1 if context_parallel > 1 else require_tp(cfg, tp, name, "torchtitan")  # CP runs at TP 1
        if cfg.seq_shards is not None:
            raise Unsupported("torchtitan's sequence parallelism is DTensor's Shard(1): torch.chunk's split, no "
                              "explicit seq_shards")
        if attn_backend == "flex" and (why := flex_limits(cfg)) is not None:
            raise Unsupported(f"attention backend 'flex': {why}")
        if attn_backend == "flex" and spmd_backend != "partial_dtensor":
            raise Unsupported(f"FlexAttention with document masks on the {spmd_backend} backend is not wired here "
                              f"(partial_dtensor only)")
        if attn_backend not in ("sdpa", "flex") and not torch.cuda.is_available():
            raise Unsupported(f"attention backend {attn_backend!r}: GPU only (torchtitan's varlen attention is a CUDA "
                              f"kernel)")
        if not cfg.causal:
            raise Unsupported("torchtitan's language models are causal (ScaledDotProductAttention is_causal=True)")
        if cfg.layout != "bsh":
            raise Unsupported(f"layout {cfg.layout}: torchtitan's llama3 is (batch, seq, hidden)")
        kv = cfg.num_kv_heads or cfg.num_heads
        # torchtitan's own check (Decoder.Config.update_from_config), and SP's even split of the sequence
        if cfg.num_heads % run_tp or kv % run_tp:
            raise Unsupported(f"torchtitan: tensor_parallel_degree ({run_tp}) must divide n_heads "
                              f"({cfg.num_heads}) and n_kv_heads ({kv})")
        if cfg.seq_len % run_tp:
            raise Unsupported(f"torchtitan: sequence parallelism requires seq_len ({cfg.seq_len}) divisible by the "
                              f"TP degree ({run_tp}) (ParallelDims.seq_len_divisor)")
        if cfg.hidden % cfg.num_heads:
            raise Unsupported(f"dim ({cfg.hidden}) is not a multiple of n_heads ({cfg.num_heads})")
        if spmd_backend == "spmd_types" and (why := spmd_limits(cfg, dp=cfg.dp)) is not None:
            raise Unsupported(why)
        if (why := models[model].limits(cfg, _run_shapes(shapes, cfg), tp=run_tp,
                                           context_parallel=context_parallel)) is not None:
            raise Unsupported(why)
        check_unsupported(cfg, loss)

    def build_reference(cfg):
        torch.manual_seed(cfg.seed)
        built = _build(model_config(model, _run_shapes(shapes, cfg), enable_sp=enable_sp, attn_backend=attn_backend),
                       torch.float64)
        if attn_backend == "flex":
            reference_documents(built)
        return built

    def make_batch(cfg, step, gen):
        rows = cfg.dp * cfg.batch
        tokens = torch.randint(0, cfg.vocab, (rows, cfg.seq_len), generator=gen)
        labels = torch.randint(0, cfg.vocab, (rows, cfg.seq_len), generator=gen)
        inputs = {}
        if attn_backend == "flex":
            inputs["positions"] = document_positions(rows, cfg.seq_len, documents, gen)
        if loss is not None:
            tokens, labels = titan_batch(loss, tokens, labels, gen)
        return Batch(inputs={"tokens": tokens, **inputs}, target=labels)

    defaults.update(case_fields.pop("defaults", {}))
    if context_parallel > 1:
        shard = torchtitan_cp_shard(shapes, attn_backend=attn_backend, model=model, loss=loss)
    elif spmd_backend == "spmd_types":
        shard = torchtitan_spmd_shard(shapes, enable_sp=enable_sp, attn_backend=attn_backend,
                                      edit_sharding=edit_sharding, model=model, loss=loss)
    else:
        shard = torchtitan_shard(shapes, enable_sp=enable_sp, attn_backend=attn_backend, edit_sharding=edit_sharding,
                                 model=model, loss=loss)
    loss_fields = case_loss_fields(loss) if loss is not None else dict(
        loss_sum=lambda out, tgt: F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1), reduction="sum"),
        tokens=lambda tgt: tgt.numel())
    loss_note = f", {loss.describe()}" if loss is not None else ""
    return Case(name=name, description=f"torchtitan {TORCHTITAN_VERSION} {model}, {dict(model_kwargs)}, "
                                       f"{'TP + SP' if enable_sp else 'TP'} sharding config, {spmd_backend} backend"
                                       f"{loss_note}",
                build_reference=build_reference, make_batch=make_batch,
                shard=shard, **loss_fields, input_layout=Layout(seq_dim=1, batch_dim=0), validate=validate,
                defaults=defaults, tags=("torchtitan", "framework", *case_fields.pop("tags", ())), **case_fields)


__all__ = ["CP_STEP", "TORCHTITAN_VERSION", "cpu_shims", "llama3_config", "model_config", "preload", "registry_models", "retie", "torchtitan_case",
           "torchtitan_cp_shard", "torchtitan_shard", "torchtitan_spmd_shard"]
