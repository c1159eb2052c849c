"""Stage: step. torchtitan's `spmd_types` backend (`parallelism.spmd_backend="spmd_types"`, its
0.3.0 default) as the sharded twin of a `torchtitan_case(..., spmd_backend="spmd_types")`.

Under this backend torchtitan's `Module.parallelize` keeps every param a plain local tensor
(`spmd_distribute_tensor`: this rank's chunk of a `S(d)` param, the whole of an `R` / `I` one)
annotated with its spmd type, and each module's forward redistributes its local activations
with spmd_types' own collectives (all-gather, reduce-scatter, all-reduce on the "tp" axis of
torchtitan's dense mesh). What runs, as torchtitan's trainer runs it:

- `ParallelDims(..., spmd_backend="spmd_types").build_mesh()`: torchtitan's own meshes (world,
  dataloading, loss, its spmd dense mesh ("dp", "cp", "tp")), size-1 axes on its "fake" backend.
- `model.parallelize(parallel_dims)`: the llama3 sharding config the case sets, the first step
  of torchtitan's `parallelize_llama` under this backend.
- The forward inside `dist_utils.get_spmd_context(parallel_dims=...)` (the trainer's
  `train_context`: the dense mesh made current), its tokens annotated by
  `annotate_input_spmd_types` as `post_dataloading_process` does.
- The loss: torchtitan's `cross_entropy_loss` on the vocab-parallel logits (its
  `_LossParallelCrossEntropy`, three TP all-reduces), divided by the replica's tokens.

Two things are not torchtitan's, each named:

1. CPU shim: torchtitan's `build_mesh` makes its world mesh on `torchtitan.tools.utils.device_type`,
   "cuda" on a CPU-only torch; `parallel_dims.device_type` is set to "cpu" for the call. A mesh's
   device only says where its collectives run (gloo here, nccl there): the math is the same.
2. torch-version gap (not CUDA's): under SP torchtitan declares the norm weights `R` on TP, whose
   backward leaves a partial grad on each rank ("pending BWD AR handled by FSDP",
   `decoder_sharding.norm_config`). torchtitan's `parallelize_llama` always ends in
   `apply_fsdp_to_decoder(..., dp_mesh_dims=...)`, and torch 2.13.0's `fully_shard` refuses
   spmd_types' plain params there ("When dp_mesh_dims is provided, all parameters must be
   DTensors on the full SPMD mesh"; the translation is pytorch/pytorch#181519). So the case's
   `sync_grads` does the one reduction `fully_shard` would: a SUM all-reduce over TP of the grad
   of every param whose declared spmd type on "tp" is `R`, read from torchtitan's own
   `state_shardings` (a layout declared wrong is still wrong here: the mutant beside the cases).
   Without SP nothing is `R` on TP (norms are `I`) and nothing is reduced.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness import Layout, ParamSpec, RankContext, Sharded
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.cases.frameworks.torchtitan.loss import titan_local_loss
from sp_harness.cases.frameworks.torchtitan.models import retie


def spmd_parallel_dims(tp: int, world_size: int):
    """torchtitan's `ParallelDims` for TP `tp` on the spmd_types backend, its meshes built by its
    own `build_mesh` on "cpu" (CPU shim 1 above) over this world (dp = cp = pp = 1)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=world_size,
                        spmd_backend="spmd_types")
    device = parallel_dims_module.device_type
    parallel_dims_module.device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dims.build_mesh()
    finally:
        parallel_dims_module.device_type = device
    return dims


def _spmd_types_on_tp(model: nn.Module) -> dict[str, Any]:
    """Each param's declared spmd type on the "tp" axis, from torchtitan's `state_shardings`."""
    from torchtitan.distributed.parallel_dims import MeshAxisName

    types = {}
    for prefix, module in model.named_modules():
        config = getattr(module, "_sharding_config", None)
        if config is None:
            continue
        for name, _ in module.named_parameters(recurse=False):
            layout = config.state_shardings[name]
            types[f"{prefix}.{name}" if prefix else name] = layout.axis_types.get(MeshAxisName.TP)
    return types


def _whole_outputs(model: nn.Module) -> tuple[str, ...]:
    """The modules holding params whose declared output type on TP is complete: `R` / `I`, or the
    sequence (dim 1) sharded over TP (SP's `S(1)`, or a partition spec naming TP on dim 1). Their
    redistribution runs in torchtitan's own module hooks, registered before the engine's, so the
    engine's trace sees the declared type: a vocab-parallel embedding's lookup reduce-scattered
    to the sequence shard, a row-parallel linear's partial sums reduced."""
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName

    tp = MeshAxisName.TP
    whole = []
    for name, module in model.named_modules():
        config = getattr(module, "_sharding_config", None)
        if config is None or not any(True for _ in module.parameters(recurse=False)):
            continue
        out = config.out_dst_shardings or config.out_src_shardings
        if out is None:
            continue
        kind = out.axis_types.get(tp)
        spec = out.partition_spec
        on_seq = spec is not None and len(spec) > 1 and tp in (spec[1] if isinstance(spec[1], tuple) else (spec[1],))
        if kind is spmd.R or kind is spmd.I or (isinstance(kind, spmd.Shard) and kind.dim == 1) or on_seq:
            whole.append(name)
    return tuple(whole)


def _param_specs(model: nn.Module) -> dict[str, ParamSpec]:
    """Local params to the reference's (same names): `S(d)` on TP is split on d (torch.chunk, as
    `spmd_distribute_tensor` cuts), `R` / `I` whole on every TP rank."""
    import spmd_types as spmd

    specs = {}
    for name, kind in _spmd_types_on_tp(model).items():
        specs[name] = ParamSpec(ref_name=name, dim=kind.dim) if isinstance(kind, spmd.Shard) else ParamSpec(ref_name=name)
    return specs


def _pending_tp_reduction(model: nn.Module, tp_group) -> Callable[[], None]:
    """The grad all-reduce over TP that torchtitan leaves to `fully_shard` for params declared `R`
    on TP (CPU-independent gap 2 above): their local grads are partial sums."""
    import spmd_types as spmd

    names = {n for n, kind in _spmd_types_on_tp(model).items() if kind is spmd.R}
    pending = [p for n, p in model.named_parameters() if n in names]

    def sync() -> None:
        for param in pending:
            if param.grad is not None:
                dist.all_reduce(param.grad, group=tp_group)

    return sync


def _run_in_train_context(model: nn.Module, dims) -> None:
    """The model's forward inside torchtitan's `train_context` with its tokens annotated, as the
    trainer's `_forward_backward_body` and `post_dataloading_process` run it (hooks, so the
    module tree and its names stay torchtitan's)."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
    stacks: list[ExitStack] = []

    def enter(module, args, kwargs):
        stack = ExitStack()
        stack.enter_context(context())
        stacks.append(stack)
        tokens = kwargs["tokens"] if "tokens" in kwargs else args[0]
        # labels are annotated beside the tokens in torchtitan; the engine's target never enters
        # the model, so the tokens stand in for the call (their type is all it sets)
        annotate_input_spmd_types(dims, tokens, tokens.detach().clone(), {})
        return args, kwargs

    def leave(module, args, kwargs, output):
        stacks.pop().close()
        return output

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def spmd_types_shard(build: Callable[[RankContext], Any], vocab: Callable[[RankContext], int], *,
                     loss: TokenLoss | None = None, count: str = "valid"):
    """A `Case.shard` for torchtitan's spmd_types backend: `build(ctx)` is this rank's model, not
    yet parallelized, loaded by this factory with the reference's state. `loss`, `count`: the
    rank's loss as torchtitan_loss's `titan_local_loss` computes it (None: torchtitan's cross
    entropy over every label)."""

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.distributed.spmd_types import set_current_spmd_mesh
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend("spmd_types")
        model = build(ctx)
        model.load_state_dict(reference.state_dict())
        # build_mesh makes new process groups: once per rank process, not once per job on a warm pool
        dims = ctx.once(("torchtitan spmd_types ParallelDims", ctx.tp, ctx.world_size),
                        lambda: spmd_parallel_dims(ctx.tp, ctx.world_size))
        model.parallelize(dims)
        retie(model)
        _run_in_train_context(model, dims)
        global_vocab = vocab(ctx)

        def plain_loss(out: torch.Tensor, target: torch.Tensor, _ctx: RankContext) -> torch.Tensor:
            # torchtitan's loss_fn runs inside train_context, where its vocab-parallel branch
            # finds the TP group on the current mesh
            with set_current_spmd_mesh(dims.spmd_dense_mesh()):
                return cross_entropy_loss(out, target, global_vocab_size=global_vocab) / target.numel()

        local_loss = plain_loss if loss is None else titan_local_loss(loss, vocab=global_vocab,
                                                                       spmd_mesh=dims.spmd_dense_mesh, count=count)
        io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)
        return Sharded(module=model, input_layout=io,
                       output_layout=Layout(seq_dim=1, batch_dim=0, seq_sharded=False, split_dim=-1),
                       params=_param_specs(model), whole_outputs=_whole_outputs(model), sync_grads=_pending_tp_reduction(model, dims.get_mesh("tp").get_group()),
                       local_loss=local_loss)

    return shard


def spmd_limits(cfg, *, dp: int) -> str | None:
    """Why a config cannot run on this backend here, or None."""
    if dp > 1:
        return ("torchtitan's spmd_types data parallelism is apply_fsdp_to_decoder(..., dp_mesh_dims=...), and torch "
                "2.13.0's fully_shard refuses spmd_types' plain params there (pytorch/pytorch#181519 adds the "
                "translation): DP 1 only")
    if cfg.dtype == "float64":
        return ("torchtitan's vocab-parallel cross entropy computes in float32 (_LossParallelCrossEntropy: "
                "logits.flatten(0, -2).float()): its loss and the grads it sends back are float32 in a float64 run")
    return None


__all__ = ["spmd_limits", "spmd_parallel_dims", "spmd_types_shard"]

