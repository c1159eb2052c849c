"""Stage: step. torchtitan 0.3.0's OWN trainer step as a case's
`Sharded.train_step`, so the training-step check (`sp-harness check --train-step`) judges
torchtitan's gradient accumulation, global-token loss normalisation, grad clipping and optimizer
container on its llama3 under its TP + SP plan (DTensor) and, at dp > 1, its FSDP2.

    from sp_harness.cases.frameworks.torchtitan.step import titan_train_case
    LLAMA3_SP_STEP = titan_train_case("titan-llama3-sp-step", dict(dim=32, n_layers=2, n_heads=4, vocab_size=64))

What runs is torchtitan's code, unchanged:
- `Trainer.train_step` (trainer.py:871-1011) itself, bound to a light trainer (`TitanTrainer`)
  that holds only the attributes it and `forward_backward_step` / `post_dataloading_process` /
  `_forward_backward_body` read: it counts `labels != IGNORE_INDEX` over the K micro-batches,
  sums the count over the "batch" mesh (`dist_sum_tensor`: the global valid tokens), runs
  forward + backward per micro-batch with torchtitan's `CrossEntropyLoss` (sum over tokens /
  global valid tokens; vocab-parallel `_LossParallelCrossEntropy` on the Shard(-1) logits), sums
  the K detached losses and logs `dist_sum` of that over the "loss" mesh: the reported loss is
  what it hands `metrics_processor.log` (global_avg_loss).
- Grads over DP: `apply_fsdp_to_decoder`, its grad division off as torchtitan leaves it (the
  global-token loss summed over DP is the mean): `torchtitan_shard` sets it back to DP for the
  side-by-side check's per-replica mean loss, so the first `accumulate` turns it off again with
  torchtitan's own `disable_fsdp_gradient_division`.
- `dist_utils.clip_grad_norm_` (distributed/utils.py:599): `torch.nn.utils.get_total_norm` over
  the DTensor grads, `.full_tensor()`, `clip_grads_with_norm_`.
- The optimizer is torchtitan's `OptimizersContainer` over the model's DTensor params, one param
  group `.*` (weight decay on every param), `implementation="for-loop"` (its "fused" default is
  CUDA only); its inner torch optimizer is `TrainStep.optimizer` (state readable per param).

The split the check needs: the engine reads the grads after accumulation and before clipping,
and `train_step` clips and steps in one call. So `accumulate` runs `train_step` with
`training.max_norm = inf` and its `optimizers.step()` held back (`_HeldOptimizers`); `step()`
then makes the two calls train_step would have made next, with the run's clip threshold:
`clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=None, ep_enabled=False)` and
`optimizers.step()`. The clip at inf multiplies every grad by clamp(inf / (norm + 1e-6), max=1)
= 1.0 exactly, which leaves each finite value bit for bit; `grad_norm()` is that same call (the
norm torchtitan computes, with no change to the grads). torchtitan has no norm-only function.

The light trainer's other parts are the trainer's bookkeeping, outside the math: a constant LR
schedule (the check's lr), a checkpointer that stages nothing, a metrics processor that logs
every step and records what it is handed. Its `ParallelDims` holds the harness's meshes:
"batch" and "loss" are the DP mesh (torchtitan flattens batch x cp; cp is 1), "pp" a size-1
mesh with no process group (torchtitan only asks its size, and a size-1 axis returns None).

CPU (`cpu_shims`, sp_harness.cases.frameworks.torchtitan.case): the triton-kernel module stand-in and
FSDP2's SUM-only reductions on gloo, both no-ops on a CUDA install; nothing here adds another.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sp_harness import Case, Sharded, Unsupported
from sp_harness.cases.frameworks.torchtitan.case import CP_STEP, torchtitan_case, torchtitan_shard
from sp_harness.config.rank_context import RankContext
from sp_harness.config.step_protocol import MicroBatch, TrainLoss
from sp_harness.step.optim_ref import ADAMW_BETAS, ADAMW_EPS, SGD_MOMENTUM, WEIGHT_DECAY

IGNORE_INDEX = -100
"""torchtitan's `components.loss.IGNORE_INDEX`, the check's `TrainLoss.ignore_index` default."""


@dataclass(kw_only=True, frozen=True)
class TitanStepConfig:
    """How the case builds torchtitan's step; every default is torchtitan's own trainer."""

    per_micro_batch_mean: bool = False
    """torchtitan before pytorch/torchtitan#2206: each micro-batch's loss the mean over its own
    valid tokens divided by the accumulation steps (`rescale_accumulated_loss`), with FSDP
    averaging grads over DP. Expressed through the trainer's `loss_fn` slot and FSDP's divide
    factor; the trainer's loop and logging stay 0.3.0's."""
    fsdp_grad_division: bool = False
    """FSDP's grad division over DP left on (divide factor = DP) under torchtitan's global-token
    loss: grads divided by DP twice (pytorch/torchtitan#2318, the DDP / HSDP path #2323 fixed)."""
    norm_local_only: bool = False
    """The clip norm over each rank's local grad pieces, never reduced over the ranks holding the
    others: each rank clips by the norm of its own shards (the class of pytorch/torchtitan#596,
    the norm missing the other pipeline stages' params, fixed in #649)."""


class _HeldOptimizers:
    """train_step's `optimizers` during `accumulate`: zero_grad is the container's, step is held
    back for `TitanTrainStep.step` (the engine reads the grads between)."""

    def __init__(self, container):
        self.container = container

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.container.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        pass


class _ConstantLR:
    """The check's lr, constant: torchtitan's `LRSchedulersContainer` with no warmup or decay."""

    def get_metrics(self) -> dict:
        return {}

    def step(self) -> None:
        pass


class _NoCheckpoint:
    def maybe_wait_for_staging(self) -> None:
        pass


class _Metrics:
    """Logs every step (`should_log`) and keeps what train_step hands `log`."""

    def __init__(self) -> None:
        self.logged: list[tuple[float, float, float]] = []
        self.ntokens_since_last_log = 0

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: Mapping[str, Any] | None = None) -> None:
        self.logged.append((float(global_avg_loss), float(global_max_loss), float(grad_norm)))


def _trainer_class():
    from torchtitan.trainer import Trainer

    class TitanTrainer:
        """torchtitan's `Trainer` step methods on an object holding only what they read."""

        train_step = Trainer.train_step
        forward_backward_step = Trainer.forward_backward_step
        post_dataloading_process = Trainer.post_dataloading_process
        _forward_backward_body = Trainer._forward_backward_body

    return TitanTrainer


def _pre_2206_loss(accumulation_steps: Callable[[], int]):
    """torchtitan's loss before pytorch/torchtitan#2206 in 0.3.0's `loss_fn` slot: the cross
    entropy's mean over this micro-batch's valid tokens (then `F.cross_entropy`'s default
    reduction), divided by the accumulation steps (its `RescaleAccumulatedLoss`); the global token
    count it is handed is ignored. An empty micro-batch's mean is 0/0 = NaN there: here its sum
    (0) over max(count, 1), so the check sees the weighting, not a NaN."""
    from torchtitan.components.loss import CrossEntropyLoss

    class PerMicroBatchMean(CrossEntropyLoss):
        def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
            loss_sum = self.fn(pred, labels, global_vocab_size=self.global_vocab_size)
            count = (labels != IGNORE_INDEX).sum().clamp(min=1)
            return loss_sum / count / accumulation_steps(), {}

    return PerMicroBatchMean(CrossEntropyLoss.Config())


@torch.no_grad()
def _clip_grad_norm_local_only(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                               foreach: bool | None = None, pp_mesh=None, ep_enabled: bool = False) -> torch.Tensor:
    """torchtitan 0.3.0's `clip_grad_norm_` (distributed/utils.py:599-677, no PP, no EP) with the
    norm taken over each grad's local piece (`to_local()`): a plain tensor, so nothing reduces it
    over the ranks holding the other pieces. (Its own `.full_tensor()` line is a no-op in torch
    2.13, where `get_total_norm` of DTensors already returns a Replicate norm: reading that
    locally changes nothing.)"""
    from torch.distributed.tensor import DTensor

    parameters = list(parameters)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


def _optimizers(model: nn.Module, optimizer: str, lr: float):
    """torchtitan's `OptimizersContainer` with optim_ref's hyper-parameters on one group `.*`. SGD
    is added to its factory table (`_resolve_optimizer_factory` knows Adam, AdamW, DistMuon): the
    container's documented extension, a subclass."""
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    class Container(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name: str):
            return torch.optim.SGD if name == "SGD" else OptimizersContainer._resolve_optimizer_factory(name)

    if optimizer == "sgd":
        group = ParamGroupConfig(pattern=".*", optimizer_name="SGD", optimizer_kwargs=dict(
            lr=lr, momentum=SGD_MOMENTUM, dampening=0.0, weight_decay=0.0, nesterov=False))
    else:
        group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=dict(
            lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=WEIGHT_DECAY))
    return Container(Container.Config(param_groups=[group], implementation="for-loop"), model_parts=[model])


def _trainer_dims(ctx: RankContext):
    """torchtitan's `ParallelDims` as train_step reads it: "batch" and "loss" the DP mesh, "pp" a
    size-1 mesh without a process group (only its size is read)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=ctx.dp, cp=1, tp=ctx.tp, pp=1, ep=1, world_size=ctx.world_size,
                        spmd_backend="partial_dtensor")
    single = DeviceMesh("cpu", [ctx.rank], mesh_dim_names=("pp",), _init_backend=False)
    meshes = {"pp": single, "cp": single, "batch": single, "loss": single}
    if ctx.dp > 1:
        meshes["batch"] = meshes["loss"] = ctx.device_mesh["dp"]
    dims._single_axis_meshes = meshes
    return dims


class TitanTrainStep:
    """torchtitan's trainer step over one rank's parallelized llama3 (a `TrainStep`)."""

    def __init__(self, module: nn.Module, ctx: RankContext, step: TitanStepConfig = TitanStepConfig()):
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.distributed import utils as dist_utils

        config = ctx.config
        assert config.optimizer is not None and config.lr is not None, "the check resolves optimizer and lr"
        self.module, self.max_norm = module, config.clip_grad_norm
        # torchtitan's trainer runs with FSDP's division off; both pre-fix mutants keep it at DP
        self.fsdp_division_off = not (step.per_micro_batch_mean or step.fsdp_grad_division)
        self.params = list(module.parameters())
        self.container = _optimizers(module, config.optimizer, config.lr)
        self.optimizer = self.container.optimizers[0]
        self.clip = _clip_grad_norm_local_only if step.norm_local_only else dist_utils.clip_grad_norm_
        trainer = _trainer_class()()
        dims = _trainer_dims(ctx)
        trainer.config = SimpleNamespace(training=SimpleNamespace(max_norm=math.inf, disable_cuda_graphs=True),
                                         parallelism=SimpleNamespace(spmd_backend="partial_dtensor"))
        trainer.parallel_dims, trainer.device, trainer.model_parts = dims, torch.device("cpu"), [module]
        trainer.model_config = None  # read only to build Flex / varlen masks from positions: none here
        trainer.loss_fn = (_pre_2206_loss(lambda: trainer.gradient_accumulation_steps)
                           if step.per_micro_batch_mean else CrossEntropyLoss(CrossEntropyLoss.Config()))
        trainer.optimizers = _HeldOptimizers(self.container)
        trainer.lr_schedulers, trainer.checkpointer, trainer.metrics_processor = _ConstantLR(), _NoCheckpoint(), _Metrics()
        trainer.train_context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
        trainer.fwd_bwd_fn = trainer._forward_backward_body
        trainer.num_pipeline_parallel_microbatches = 1
        trainer.step, trainer.ntokens_seen = 0, 0
        self.trainer = trainer

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> float:
        trainer = self.trainer
        if self.fsdp_division_off:
            from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

            disable_fsdp_gradient_division(self.module)
            self.fsdp_division_off = False
        trainer.gradient_accumulation_steps = len(micro_batches)
        trainer.step += 1
        data: Iterator = iter([({"input": mb.inputs["tokens"]}, mb.target) for mb in micro_batches])
        trainer.train_step(data)
        return trainer.metrics_processor.logged[-1][0]

    def grad_norm(self) -> torch.Tensor:
        return self.clip(self.params, math.inf, foreach=True, pp_mesh=None, ep_enabled=False)

    def step(self) -> torch.Tensor:
        max_norm = math.inf if self.max_norm is None else self.max_norm
        norm = self.clip(self.params, max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
        self.container.step()
        self.container.zero_grad()
        return norm


def titan_step_shard(shapes: Mapping[str, Any], step: TitanStepConfig = TitanStepConfig(),
                     edit_sharding: Callable[[Any], None] | None = None):
    """The sharded factory of a `titan_train_case`: `torchtitan_shard`'s llama3 (its TP + SP plan,
    at dp > 1 its FSDP2, the grad division at DP for the side-by-side check's per-replica mean:
    `TitanTrainStep` turns it off as torchtitan's trainer has it) with a `TitanTrainStep`."""
    shard = torchtitan_shard(shapes, edit_sharding=edit_sharding)

    def sharded(reference: nn.Module, ctx: RankContext) -> Sharded:
        made = shard(reference, ctx)
        return dataclasses.replace(made, train_step=TitanTrainStep(made.module, ctx, step))

    return sharded


def titan_train_case(name: str, model_kwargs: Mapping[str, Any], *, tp: int | None = None,
                     step: TitanStepConfig = TitanStepConfig(), context_parallel: int = 1,
                     **case_fields: Any) -> Case:
    """A `torchtitan_case` (llama3 of `model_kwargs`, TP + SP, FSDP2 at dp > 1) whose training step
    is torchtitan's own trainer step, judged by `--train-step` against the token mean of the
    cross entropy over every valid token. `context_parallel` > 1 is Unsupported (`CP_STEP`).
    `case_fields`: as `torchtitan_case`'s."""
    base = torchtitan_case(name, model_kwargs, tp=tp, **case_fields)
    shapes = {"n_layers": 2, "n_heads": 4, "vocab_size": 64, "multiple_of": 16, "dim": 32, **model_kwargs}

    def validate(cfg):
        if context_parallel > 1:
            raise Unsupported(CP_STEP)
        assert base.validate is not None
        base.validate(cfg)
        if cfg.train_step and cfg.dtype == "float64":
            raise Unsupported("torchtitan's cross entropy casts the logits to float32 (components/loss.py:46, "
                              "`.float()`): its loss and the grads it sends back are float32 in a float64 run")

    return dataclasses.replace(
        base, validate=validate, shard=titan_step_shard(shapes, step),
        loss_sum=lambda out, tgt: F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1),
                                                  ignore_index=IGNORE_INDEX, reduction="sum"),
        tokens=lambda tgt: int((tgt != IGNORE_INDEX).sum()), train_loss=TrainLoss(ignore_index=IGNORE_INDEX),
        description=base.description + ", torchtitan's own trainer step")


__all__ = ["TitanStepConfig", "TitanTrainStep", "titan_step_shard", "titan_train_case"]
