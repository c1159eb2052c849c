"""Stage: step. megatron-core's OWN training step as a case's `Sharded.train_step`, so
the training-step check (`sp-harness check --train-step`) judges megatron's schedule, loss
normalisation, grad finalize, clipping and optimizer, not a hand-written copy of them.

    from sp_harness.cases.frameworks.megatron.step import MegatronStepConfig, megatron_train_case
    GPT_SP_STEP = megatron_train_case("gpt-sp-step", dict(num_layers=2, hidden_size=32,
                                      num_attention_heads=4, sequence_parallel=True), tp=2)

Each optimizer step is what Megatron-LM's `train_step` does with `pretrain_gpt.py`'s functions:
- `get_forward_backward_func()` (no pipelining) over the K micro-batches, with a forward-step
  function that calls the GPTModel with `labels` and a loss function over `loss_mask` (the
  engine's valid tokens) returning megatron's 3-tuple (local loss sum, local token count,
  report); with `calculate_per_token_loss=True` (the default; the case's `TransformerConfig`
  keywords or `MegatronStepConfig` may say False: megatron's legacy per-rank normalisation) the
  schedule hands the summed token count to `finalize_model_grads` (the DP all-reduce, the TP sum
  of the `sequence_parallel` params, the 1 / global tokens scaling); `no_sync_func` /
  `grad_sync_func` set as the training loop sets them. At `context_parallel_size` > 1 the model is
  megatron/cp.py's (its batch cut per CP rank before the schedule, its grads reduced over DP x CP);
- `get_megatron_optimizer(OptimizerConfig(...), [ddp_model], config_overrides={})` (every param
  decayed alike) with megatron's constant `OptimizerParamScheduler`; `optimizer.step()` (prepare
  grads, clip by `clip_grad_by_total_norm_fp32`, step, copy master weights back) then
  `zero_grad_buffer()` and `zero_grad()`;
- the reported loss is what the training loop logs: the reports summed over micro-batches,
  all-reduced over DP, sum / count.
Its optimizer state lives in megatron's wrappers (fp32 master weights in bfloat16, DP shards
with the distributed optimizer), so `optimizer` is None: the engine judges each update against
its float64 shadow of the same optimizer, driven by megatron's own clipped grads.

CPU (only where CUDA is absent; `cuda_on_cpu`): megatron's schedule, optimizers and clipping
allocate small tensors on "cuda" (the token counter, the loss scale of one, the fused kernels'
overflow flag, the norm's result) and dispatch on `Tensor.type()`'s CUDA names (fp32 params vs
16-bit ones with fp32 master copies; clipping asserts 'torch.cuda.FloatTensor' grads). While
megatron's step runs, a TorchFunctionMode makes device="cuda" the CPU and `Tensor.type()` answer
the CUDA name of the same dtype; with `megatron_runtime.cpu_shims`' `torch.cuda.current_device` that is all
(no `Tensor.cuda()` call is reached on this path). No number changes: the same dtype and values
on the other device, and each type check decides by the dtype the name carries.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from sp_harness import Case, Sharded, Unsupported
from sp_harness.cases.frameworks.megatron.case import megatron_case, megatron_shard
from sp_harness.cases.frameworks.megatron.compat import every_param_decayed
from sp_harness.cases.frameworks.megatron.loss import PerTokenLosses, SmoothingStats, loss_func, per_token_losses
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.config.rank_context import RankContext
from sp_harness.config.step_protocol import MicroBatch, TrainLoss
from sp_harness.step.optim_ref import ADAMW_BETAS, ADAMW_EPS, SGD_MOMENTUM, WEIGHT_DECAY

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

IGNORE_INDEX = -100
"""The target value with no loss (`TrainLoss`'s default); megatron never sees it: its labels get a
valid token id there and `loss_mask` removes it."""


@dataclass(kw_only=True, frozen=True)
class MegatronStepConfig:
    """How megatron's own training step is set up, as Megatron-LM's arguments would set it."""

    use_distributed_optimizer: bool = False
    """megatron's `DistributedOptimizer` (ZeRO-1: grads reduce-scattered over DP, each replica
    stepping its shard of fp32 main params, params all-gathered back). Adam only (megatron asserts
    it); SGD is UNSUPPORTED with it."""
    calculate_per_token_loss: bool | None = None
    """True: the loss function's sum is divided by the global valid-token count
    (`finalize_model_grads` with `num_tokens`), the token mean the case declares. False: megatron's
    legacy mode, each micro-batch's sum divided by its own count and by K, grads averaged over DP
    (and CP): a mean of per-micro-batch, per-rank means. None: the `TransformerConfig` keywords'
    `calculate_per_token_loss` where they set it, else True; set in both places, the two must agree
    (`per_token_loss`)."""
    overlap_grad_reduce: bool = False
    """megatron's DDP launches each bucket's DP reduction from the backward hooks as its grads are
    ready (the training loop then sets `no_sync_func` and `grad_sync_func`)."""


class _CudaOnCPU(TorchFunctionMode):
    """What megatron asks of CUDA, answered on the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)  # the same dtype's CUDA name
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    return isinstance(device, int) or torch.device(device).type == "cuda"  # an int is a CUDA ordinal


def cuda_on_cpu() -> contextlib.AbstractContextManager:
    """The CPU shim around megatron's step; nothing where CUDA is available."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaOnCPU()


def _ddp_config(step: MegatronStepConfig) -> Callable[[Any], Mapping[str, Any]]:
    def config(run) -> Mapping[str, Any]:
        # Megatron-LM turns on --accumulate-allreduce-grads-in-fp32 for bf16 models: main_grad in fp32
        return dict(grad_reduce_in_fp32=run.torch_dtype == torch.bfloat16, overlap_grad_reduce=step.overlap_grad_reduce,
                    use_distributed_optimizer=step.use_distributed_optimizer)

    return config


def _forward_step(data_iterator, model, losses: PerTokenLosses | None = None):
    """pretrain_gpt.py's forward step: the GPTModel with labels returns per-token losses; with
    `losses` (label smoothing, a user loss) the model returns its logits and the loss function
    makes them, as a user's forward step does."""
    from megatron.core import parallel_state

    batch = next(data_iterator)
    if losses is None:
        output = model(**batch["inputs"], labels=batch["labels"])
    else:
        logits = model(**batch["inputs"])
        output = losses(logits, batch["labels"], parallel_state.get_tensor_model_parallel_group())
    return output, partial(loss_func, batch["loss_mask"])


class MegatronTrainStep:
    """megatron-core's own training step on one rank (`TrainStep`)."""

    def __init__(self, ddp: DistributedDataParallel, ctx: RankContext, step: MegatronStepConfig,
                 losses: PerTokenLosses | None = None):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.utils import get_model_config

        run = ctx.config
        assert run.optimizer is not None and run.lr is not None, "the check resolves optimizer and lr"
        self.ddp, self.ctx, self.losses = ddp, ctx, losses
        self.optimizer = None  # megatron's state is in its wrappers: the engine's float64 shadow judges the update
        config = get_model_config(ddp)
        # what Megatron-LM's training loop sets on the model config
        config.finalize_model_grads_func = self._finalize(finalize_model_grads, step.use_distributed_optimizer)
        if step.overlap_grad_reduce:
            config.no_sync_func = ddp.no_sync
            config.grad_sync_func = ddp.start_grad_sync
        adam = run.optimizer == "adamw"
        wd = WEIGHT_DECAY if adam else 0.0
        bf16 = run.torch_dtype == torch.bfloat16
        opt_config = OptimizerConfig(
            optimizer="adam" if adam else "sgd", lr=run.lr, min_lr=run.lr, weight_decay=wd,
            adam_beta1=ADAMW_BETAS[0], adam_beta2=ADAMW_BETAS[1], adam_eps=ADAMW_EPS, decoupled_weight_decay=True,
            sgd_momentum=SGD_MOMENTUM, bf16=bf16, params_dtype=run.torch_dtype,
            use_distributed_optimizer=step.use_distributed_optimizer, clip_grad=run.clip_grad_norm or 0.0)
        with cuda_on_cpu():
            # no weight-decay exemption (biases, norms), as the engine's AdamW decays every param: config_overrides={}
            # on 0.16, no_weight_decay_cond on 0.15 (compat.every_param_decayed)
            self.megatron_optimizer = get_megatron_optimizer(opt_config, [ddp], **every_param_decayed(),
                                                             use_gloo_process_groups=False)  # checkpointing only
            self.scheduler = OptimizerParamScheduler(
                self.megatron_optimizer, init_lr=run.lr, max_lr=run.lr, min_lr=run.lr, lr_warmup_steps=0,
                lr_decay_steps=1, lr_decay_style="constant", start_wd=wd, end_wd=wd, wd_incr_steps=1,
                wd_incr_style="constant")

    def _finalize(self, finalize_model_grads, distributed: bool):
        """megatron's `finalize_model_grads`; with the distributed optimizer, each DP replica then
        holds only its own shard of the reduced grads (the rest of its buffer keeps its local
        sums, which megatron never reads again before `zero_grad_buffer`): the shards are
        all-gathered into the buffer so `grad_of` shows the whole grad. The optimizer reads only
        its shard, which the gather leaves as it was."""
        if not distributed:
            return finalize_model_grads
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        def finalize(model, num_tokens=None, **kwargs):
            finalize_model_grads(model, num_tokens, **kwargs)
            for group in [*self.ddp.bucket_groups, *self.ddp.expert_parallel_bucket_groups]:
                size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
                for bucket in group.buckets:
                    mine = shard_buffer(bucket.grad_data, size)[rank].clone()
                    dist.all_gather_into_tensor(bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group)

        return finalize

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [dict(inputs=mb.inputs, labels=torch.where(mb.valid, mb.target, torch.zeros_like(mb.target)),
                        loss_mask=mb.valid) for mb in micro_batches]
        target = micro_batches[0].target
        with cuda_on_cpu():
            reports = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, losses=self.losses), data_iterator=iter(batches),
                model=[self.ddp],
                num_microbatches=len(batches), seq_length=target.shape[-1], micro_batch_size=target.shape[0],
                forward_only=False)
        # Megatron-LM's train_step: the reports summed over micro-batches and DP, sum / count
        total = torch.vstack([r["lm loss"].view(-1) for r in reports]).sum(dim=0)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        return total[0] / total[1]

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return getattr(param, "main_grad", None)

    def grad_norm(self) -> float:
        # the optimizer's grads are made from main_grad (an alias in fp32, an fp32 copy of a
        # 16-bit param's) by prepare_grads, as its step() does before clipping
        with cuda_on_cpu():
            self.megatron_optimizer.prepare_grads()
            return self.megatron_optimizer.get_grad_norm()

    def zero_grad(self) -> None:
        """The accumulated grads dropped without a step, as Megatron-LM's train_step starts."""
        self.ddp.zero_grad_buffer()
        self.megatron_optimizer.zero_grad()

    def set_lr(self, lr: float) -> None:
        """converge's lr schedule, through the param groups' bounds megatron's scheduler reads."""
        for group in self.megatron_optimizer.param_groups:
            group["lr"] = group["max_lr"] = group["min_lr"] = lr

    def step(self) -> float:
        with cuda_on_cpu():
            ok, norm, _ = self.megatron_optimizer.step()
            if not ok:
                raise RuntimeError("megatron's optimizer skipped the step (found inf or nan in the grads)")
            self.scheduler.step(increment=1)
        # Megatron-LM's train_step zeroes them before its next forward-backward
        self.zero_grad()
        return norm


def per_token_loss(kwargs: Mapping[str, Any], step: MegatronStepConfig) -> bool:
    """The `calculate_per_token_loss` megatron's step runs with: the step config's, else the
    `TransformerConfig` keywords', else True. A ValueError where both set it and disagree: a
    keyword the step would override is a knob silently not applied."""
    given = kwargs.get("calculate_per_token_loss")
    if step.calculate_per_token_loss is None:
        return True if given is None else bool(given)
    if given is not None and bool(given) != step.calculate_per_token_loss:
        raise ValueError(f"calculate_per_token_loss={given!r} in the TransformerConfig keywords and "
                         f"MegatronStepConfig(calculate_per_token_loss={step.calculate_per_token_loss}): "
                         f"set it in one of the two")
    return step.calculate_per_token_loss


def megatron_step_shard(kwargs: Mapping[str, Any], step: MegatronStepConfig = MegatronStepConfig(), *,
                        edit_model: Callable[[nn.Module], None] | None = None,
                        gpt_kwargs: Mapping[str, Any] | None = None, layer_spec: Any = None,
                        loss: TokenLoss = TokenLoss(), smoothing: SmoothingStats = "megatron"):
    """The sharded factory of a `megatron_train_case`: `megatron_shard`'s model and DDP (configured
    as `step` says) with megatron's own training step attached. `loss`, `smoothing`: as
    `megatron_case`'s (a label-smoothed loss on the vocab-parallel logits)."""
    kwargs = {**kwargs, "calculate_per_token_loss": per_token_loss(kwargs, step)}
    shard, shard_tp1 = (megatron_shard(config, edit_model=edit_model, ddp_config=_ddp_config(step),
                                       gpt_kwargs=gpt_kwargs, layer_spec=layer_spec, loss=loss, smoothing=smoothing)
                        for config in (kwargs, {**kwargs, "sequence_parallel": False}))
    losses = per_token_losses(loss, vocab_parallel_loss=True, model_loss=False, smoothing=smoothing) \
        if loss.label_smoothing else None

    def sharded_with_step(reference: nn.Module, ctx: RankContext) -> Sharded:
        # Megatron-LM's validate_args turns sequence parallelism off at TP 1 ("disable sequence
        # parallelism when tp=1"), where megatron-core's TransformerConfig refuses it: the same
        # training run on one rank, as degree-invariance compares it
        sharded = (shard if ctx.tp > 1 else shard_tp1)(reference, ctx)
        return dataclasses.replace(sharded, train_step=MegatronTrainStep(sharded.module, ctx, step, losses))

    return sharded_with_step


def megatron_train_case(name: str, transformer_config_kwargs: Mapping[str, Any], *,
                        step: MegatronStepConfig = MegatronStepConfig(), tp: int | None = None,
                        edit_model: Callable[[nn.Module], None] | None = None,
                        gpt_kwargs: Mapping[str, Any] | None = None, layer_spec: Any = None,
                        loss: TokenLoss = TokenLoss(), smoothing: SmoothingStats = "megatron",
                        **case_fields: Any) -> Case:
    """A `megatron_case` (same model, reference and side-by-side checks) whose training step is
    megatron's own, set up as `step` says; it declares the token-mean loss ignoring -100 and runs
    in float32 unless told. `gpt_kwargs`, `layer_spec`, `loss` (its ignore_index -100; a user
    `loss_fn` needs gathered logits, which this step does not take), `smoothing`, `case_fields`:
    as `megatron_case`'s."""
    if loss.ignore_index != IGNORE_INDEX or loss.loss_fn is not None:
        raise ValueError(f"megatron_train_case({name!r}): a TokenLoss with ignore_index {IGNORE_INDEX} and no loss_fn "
                         f"(got ignore_index {loss.ignore_index}, loss_fn {loss.loss_fn}): the step takes megatron's "
                         f"vocab-parallel logits")
    # megatron's optimizer is float32 (or bfloat16 with float32 master weights): float64 is UNSUPPORTED
    case_fields["defaults"] = {"dtype": "float32", **case_fields.get("defaults", {})}
    # the side-by-side check normalises as the step does
    step = dataclasses.replace(step, calculate_per_token_loss=per_token_loss(transformer_config_kwargs, step))
    transformer_config_kwargs = {**transformer_config_kwargs, "calculate_per_token_loss": step.calculate_per_token_loss}
    base = megatron_case(name, transformer_config_kwargs, tp=tp, edit_model=edit_model, gpt_kwargs=gpt_kwargs,
                         layer_spec=layer_spec, loss=loss, smoothing=smoothing, **case_fields)

    def validate(cfg) -> None:
        base.validate(cfg)
        if cfg.torch_dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported(f"megatron-core's optimizer steps float32 or bfloat16 params, not {cfg.dtype} "
                              f"(clip_grad_by_total_norm_fp32 asserts float32 grads; get_grad_norm_fp32 rounds "
                              f"the norm to float32; float16 needs its loss scaler)")
        if step.use_distributed_optimizer and cfg.optimizer == "sgd":
            raise Unsupported("megatron-core's DistributedOptimizer supports Adam only (distrib_optimizer.py asserts it)")

    return dataclasses.replace(
        base, validate=validate, train_loss=TrainLoss(ignore_index=IGNORE_INDEX),
        tokens=lambda tgt: int((tgt != IGNORE_INDEX).sum()),
        shard=megatron_step_shard(transformer_config_kwargs, step, edit_model=edit_model, gpt_kwargs=gpt_kwargs,
                                  layer_spec=layer_spec, loss=loss, smoothing=smoothing),
        description=f"{base.description}, megatron's own training step ({step})")


def drop_tensor_parallel_flag(param_name: str) -> Callable[[nn.Module], None]:
    """An `edit_model` that removes megatron's `tensor_model_parallel` flag from one TP-split
    param after its shard is mapped: megatron's grad norm (`param_is_not_tensor_parallel_duplicate`)
    then counts it on TP rank 0 only, as it counted the learnable attention sinks'
    `softmax_offset` (NVIDIA/Megatron-LM#7452 finding 8, PR #7530)."""

    def edit(gpt: nn.Module) -> None:
        # megatron's own attribute, which torch's Parameter does not declare
        dict(gpt.named_parameters())[param_name].tensor_model_parallel = False  # type: ignore[attr-defined]

    return edit


__all__ = ["MegatronStepConfig", "MegatronTrainStep", "cuda_on_cpu", "drop_tensor_parallel_flag",
           "megatron_step_shard", "megatron_train_case", "per_token_loss"]
