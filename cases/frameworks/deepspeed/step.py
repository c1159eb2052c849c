"""Stage: step. DeepSpeed's OWN engine training step as a case's `Sharded.train_step`, so
the training-step check (`sp-harness check --train-step`) judges DeepSpeed's loss scaling,
gradient accumulation, grad reduction (ZeRO 0/1/2, CPU optimizer offload), clipping and
optimizer step, not a hand-written copy of them.

    from sp_harness.cases.frameworks.deepspeed.step import ds_step_case
    STEP = ds_step_case("my-ds-step", {"zero_optimization": {"stage": 2}})

The model is `ulysses_case`'s: the reference GPT with DeepSpeed's `DistributedAttention` around
SDPA, sequence-sharded over the rank's SP group, DeepSpeed's SP groups as the engine's `mpu`.
Each optimizer step is what a DeepSpeed user writes:

- `deepspeed.initialize(model=model, optimizer=client, config=config, mpu=parallel_state_sp)`
  once (lazily, at the first `accumulate`: the side-by-side checks of the same case backpropagate
  with `loss.backward()` themselves, which ZeRO's grad hooks must not see); `config` is the
  user's dict plus what the run decides: `train_micro_batch_size_per_gpu` (a micro-batch's
  rows), `gradient_accumulation_steps` (K, the micro-batches of the first step), `gradient_clipping` (the clip threshold), `bf16`.
- per micro-batch: `out = engine(**inputs)`, the user's loss, `engine.backward(loss)`, then
  `engine.step()`; DeepSpeed counts the micro-steps and steps the optimizer at the K-th (the
  harness reads the grads between the K-th backward and its `engine.step()`). With
  `boundary="user"`: `gradient_accumulation_steps` 1, `engine.set_gradient_accumulation_boundary`
  before each backward and one `engine.step()` (DeepSpeed's multi-backward pattern, #7665).
- The loss a correct user writes: `engine.backward` divides it by `gradient_accumulation_steps`
  and the engine averages the grads over DP (sums them over SP: `seq_dp_world_size /
  sequence_parallel_size` divides), so for the token mean over the global batch each micro-batch
  backpropagates `loss_sum * gradient_accumulation_steps * dp / N`, N the valid tokens of every
  micro-batch of every rank (one all-reduce before the first forward). It logs
  `sum(loss_sums) / N` all-reduced.
- grads before clipping: `deepspeed.utils.safe_get_full_grad(p)` (stage 0: `p.grad` itself;
  ZeRO 1/2: the partition gathered over DP, a copy; `BF16_Optimizer`'s fp32 accumulation, which
  releases before 0.19.8 read after the staging grad: `compat.full_grad`). Norm:
  `engine.get_global_grad_norm()` after the boundary `engine.step()`. Stage 0 in float32 steps the client optimizer unwrapped and
  reports no norm (None), so there the user computes it with DeepSpeed's own
  `runtime.utils.clip_grad_norm_` (the function `engine.clip_fp32_gradients` clips with, same
  `mpu`) at `max_norm=inf`, which multiplies every grad by exactly 1.

The optimizer is a client torch optimizer built with the harness's hyper-parameters
(`optim_ref.make_optimizer`: SGD momentum 0.9 or AdamW with weight decay on every param). The
engine wraps it (ZeRO's flat fp32 partitions, bf16's fp32 master copies), so `optimizer` is None
and the harness judges the update against its float64 shadow; stage 0 in float32 hands it over
unwrapped, so there it is the step's `optimizer` and its state is read.

CPU: `ZeRO-Offload` would step DeepSpeedCPUAdam, a C++ op DeepSpeed JIT-builds on first use
(8-12 minutes per machine); the config sets `"zero_force_ds_cpu_optimizer": false` (with
`zero_allow_untested_optimizer`) so the engine steps the client torch optimizer on its CPU fp32
partitions instead. Everything else of the offload path (the CPU grad accumulation buffers, the
copies into the fp32 partition, the norm from them) is DeepSpeed's own. The math is unchanged:
DeepSpeedCPUAdam is the same Adam(W) update (fused, vectorised) on the same fp32 partitions.

Mutants reintroduce upstream bugs into this engine's own ZeRO optimizer (`regress`): the installed
release's method source with the upstream fix's diff reverted, bound to that one optimizer instance
(on a release that shipped the bug, its own method: `regressed`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import textwrap
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from sp_harness import Case, Sharded, Unsupported
from sp_harness.cases.common import known
from sp_harness.cases.frameworks.deepspeed import compat
from sp_harness.cases.frameworks.deepspeed.case import sdpa_attention, ulysses_case, ulysses_shard
from sp_harness.config.rank_context import RankContext
from sp_harness.config.step_protocol import MicroBatch, TrainLoss
from sp_harness.reference.gpt import token_loss_sum
from sp_harness.step.optim_ref import make_optimizer

IGNORE_INDEX = -100
"""The target with no loss (`TrainLoss`'s default): torch's cross entropy skips it."""

REGRESSIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # deepspeedai/DeepSpeed#7967 (introduced by #6550, 0.15.2): the CPU accumulation buffer was
    # written only at micro-step 0, so micro-steps 1..K-2 were added to the GPU grad once and lost
    "7967": ("async_accumulate_grad_in_cpu_via_gpu",
             ("    if self.micro_step_id > 0:\n        accumulate_gradients()\n    copy_gradients_to_cpu()\n",),
             "    if self.micro_step_id > 0:\n        accumulate_gradients()\n    else:\n"
             "        copy_gradients_to_cpu()\n"),
    # deepspeedai/DeepSpeed#7981: the CPU accumulation ran only with gradient_accumulation_steps
    # > 1, so several backwards per step at GA 1 kept the last backward's grads alone; the fix's
    # text in 0.19.0 reads the boundary as a property, later releases call it
    "7981": ("copy_grads_in_partition",
             ("if self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary():",
              "if self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary:"),
             "if self.gradient_accumulation_steps > 1:"),
}
"""Upstream fix -> (the DeepSpeedZeroOptimizer method it changed, its text with the fix in each
release that has it, the text before the fix: what the releases that shipped the bug hold)."""


@dataclass(kw_only=True, frozen=True)
class DeepSpeedStepConfig:
    """How the user's loop drives DeepSpeed's engine."""

    boundary: Literal["engine", "user"] = "engine"
    """'engine': `gradient_accumulation_steps` K and `engine.step()` after every micro-batch
    (DeepSpeed steps the optimizer at the K-th); 'user': `gradient_accumulation_steps` 1,
    `engine.set_gradient_accumulation_boundary(k == K - 1)` before each backward and one
    `engine.step()` (several backwards per step)."""
    undo_gas_scaling: bool = True
    """The loss is multiplied by `gradient_accumulation_steps` before `engine.backward`, which
    divides it back. False: a loss already normalised over the accumulation window is divided by
    K again (a mutant's knob: grads 1/K)."""
    regress: tuple[str, ...] = ()
    """Upstream fixes (keys of `REGRESSIONS`) undone in this engine's ZeRO optimizer: a mutant's
    knob. Each needs ZeRO 1/2 with `offload_optimizer`, the code path the fix changed."""

    def __post_init__(self) -> None:
        if self.boundary not in ("engine", "user"):
            raise ValueError(f"boundary must be 'engine' or 'user', got {self.boundary!r}")
        unknown = sorted(set(self.regress) - set(REGRESSIONS))
        if unknown:
            raise ValueError(f"regress {unknown}: known upstream fixes are {sorted(REGRESSIONS)}")


def regressed(optimizer: Any, fix: str) -> None:
    """Undo upstream fix `fix` on this one ZeRO optimizer: its method's source with the fix's diff
    reverted, compiled in DeepSpeed's module and bound to the instance. On a release that shipped
    the bug (its source holds the text before the fix) nothing is undone: the release runs its
    own buggy method. Refuses a DeepSpeed whose source holds neither text exactly once."""
    method, fixes, buggy = REGRESSIONS[fix]
    func = getattr(type(optimizer), method)
    source = textwrap.dedent(inspect.getsource(func))
    held = [text for text in fixes if source.count(text) == 1]
    if not held and source.count(buggy) == 1:
        return  # this release shipped the bug
    if len(held) != 1:
        raise RuntimeError(f"this DeepSpeed's {method} holds neither #{fix}'s fix nor the text before it "
                           f"once: its source differs from the ones the mutant reverts")
    fixed = held[0]
    namespace: dict[str, Any] = {}
    exec(compile(source.replace(fixed, buggy), f"<{method} before #{fix}>", "exec"),  # noqa: S102
         vars(inspect.getmodule(func)), namespace)
    setattr(optimizer, method, types.MethodType(namespace[method], optimizer))


def _zero(config: Mapping[str, Any]) -> tuple[int, bool]:
    zero = config.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    return int(zero.get("stage", 0)), offload


class DeepSpeedTrainStep:
    """A DeepSpeed user's training loop over one rank's sharded model, one optimizer step per call
    sequence `accumulate`, `step`."""

    fixed_micro_batches = True
    """The engine's gradient_accumulation_steps is fixed at initialize (the first accumulate's K):
    accumulation-invariance, which accumulates one batch after K, needs a fresh engine."""

    def __init__(self, model: nn.Module, ctx: RankContext, *, mpu: Any, ds_config: Mapping[str, Any],
                 step: DeepSpeedStepConfig):
        cfg = ctx.config
        assert cfg.optimizer is not None and cfg.lr is not None, "the check resolves optimizer and lr"
        self.model, self.ctx, self.mpu, self.cfg, self.ds_config = model, ctx, mpu, step, ds_config
        self.stage, _ = _zero(ds_config)
        self.k = 0  # micro-batches per optimizer step: the first accumulate's, fixed in the engine's config
        self.client = make_optimizer(cfg.optimizer, cfg.lr, model.parameters())
        # stage 0 in float32 steps the client optimizer itself, over the model's params; every
        # other engine wraps it (fp32 master copies, ZeRO partitions): the shadow judges those
        self.unwrapped = self.stage == 0 and cfg.torch_dtype == torch.float32
        self.optimizer = self.client if self.unwrapped else None
        self.engine: Any = None
        self._norm: float | None = None

    def _engine(self, micro_batches: Sequence[MicroBatch]) -> Any:
        if self.engine is None:
            import deepspeed

            cfg = self.ctx.config
            # the loop's micro-batch rows and count are what the user's config says
            self.k = len(micro_batches)
            config = engine_config(self.ds_config, batch=micro_batches[0].target.shape[0], k=self.k,
                                   dtype=cfg.torch_dtype, clip=cfg.clip_grad_norm, boundary=self.cfg.boundary)
            self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=self.client, config=config, mpu=self.mpu)
            if self.unwrapped and self.engine.optimizer is not self.client:
                raise RuntimeError(f"DeepSpeed wrapped stage 0's float32 optimizer in "
                                   f"{type(self.engine.optimizer).__name__}: its state is not the client's")
            for fix in self.cfg.regress:
                regressed(self.engine.optimizer, fix)
        return self.engine

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        engine = self._engine(micro_batches)
        if len(micro_batches) != self.k:
            # its gradient_accumulation_steps is fixed at initialize; a different count never (or
            # too early) reaches the accumulation boundary
            raise ValueError(f"DeepSpeed's engine was initialised for {self.k} micro-batches per step "
                             f"(gradient_accumulation_steps), got {len(micro_batches)}")
        counts = torch.stack([mb.valid.sum() for mb in micro_batches]).to(torch.float64)
        tokens = counts.sum()
        dist.all_reduce(tokens)
        n = float(tokens.clamp(min=1))
        # engine.backward divides by gradient_accumulation_steps and the engine averages over DP
        dp = engine.seq_dp_world_size // engine.sequence_parallel_size
        gas = engine.gradient_accumulation_steps() if self.cfg.undo_gas_scaling else 1
        scale = gas * dp / n
        sums = []
        for k, mb in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            if self.cfg.boundary == "user":
                engine.set_gradient_accumulation_boundary(last)
            loss_sum = token_loss_sum(mb.call(engine), mb.target)
            sums.append(loss_sum.detach().to(torch.float64))
            engine.backward(loss_sum * scale)
            if self.cfg.boundary == "engine" and not last:
                engine.step()  # a micro-step: DeepSpeed steps the optimizer at the K-th only
        reported = torch.stack(sums).sum()
        dist.all_reduce(reported)
        return reported / n

    def set_lr(self, lr: float) -> None:
        """converge's lr schedule: the client optimizer's groups, which the engine's wrappers step."""
        for group in self.client.param_groups:
            group["lr"] = lr

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return compat.full_grad(param)

    def grad_norm(self) -> float | None:
        if not self.unwrapped:
            return None  # ZeRO's and the wrappers' norm is computed inside their step
        from deepspeed.runtime.utils import clip_grad_norm_

        # what engine.clip_fp32_gradients computes, at a max norm that scales every grad by 1
        return float(clip_grad_norm_(parameters=self.engine.module.parameters(), max_norm=math.inf,
                                     mpu=self.engine.mpu))

    def step(self) -> float:
        engine = self.engine
        norm = self.grad_norm() if self.unwrapped else None
        engine.step()
        if not self.unwrapped:
            norm = engine.get_global_grad_norm()
        if norm is None:
            raise RuntimeError("DeepSpeed's engine reported no grad norm after its boundary step")
        return float(norm)


def engine_config(user: Mapping[str, Any], *, batch: int, k: int, dtype: torch.dtype, clip: float | None,
                  boundary: str = "engine") -> dict[str, Any]:
    """The user's DeepSpeed config with what the run decides (micro-batch size, accumulation,
    clipping, bf16) and the CPU substitution of the offload optimizer. A user value that
    contradicts the run is a ValueError."""
    stage, offload = _zero(user)
    decided: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": k if boundary == "engine" else 1,
        "gradient_clipping": 0.0 if clip is None else clip,
        "bf16": {"enabled": dtype == torch.bfloat16},
        # ZeRO with a client torch optimizer (SGD is not on DeepSpeed's tested list)
        "zero_allow_untested_optimizer": True,
    }
    if offload:
        # the client torch optimizer on the CPU partitions instead of DeepSpeedCPUAdam's JIT build
        decided["zero_force_ds_cpu_optimizer"] = False
    for key, value in decided.items():
        if key in user and user[key] != value:
            raise ValueError(f"the DeepSpeed config sets {key}={user[key]!r}, the run needs {value!r} "
                             f"(batch {batch}, micro-batches {k}, clip {clip}, {dtype})")
    return {**user, **decided}


def ds_step_shard(ds_config: Mapping[str, Any], step: DeepSpeedStepConfig = DeepSpeedStepConfig()):
    """The sharded factory of a `ds_step_case`: `ulysses_shard`'s model (DistributedAttention
    around SDPA, DeepSpeed's SP groups installed) with a DeepSpeed user's training step attached.
    The side-by-side checks reduce grads with the engine's stage-0 sums written out."""
    shard = ulysses_shard(local_attention=sdpa_attention, grad_sync="all-reduce")

    def sharded_with_step(reference: nn.Module, ctx: RankContext) -> Sharded:
        from deepspeed.utils import groups

        sharded = shard(reference, ctx)
        # ulysses_shard installs DeepSpeed's SP groups as deepspeed.initialize would (None at SP 1)
        train = DeepSpeedTrainStep(sharded.module, ctx, mpu=groups.mpu, ds_config=ds_config, step=step)
        return dataclasses.replace(sharded, train_step=train)

    return sharded_with_step


ZERO3_PERSISTENCE_DEFAULT = 100_000
"""DeepSpeed's default `stage3_param_persistence_threshold`: params of at most this many elements
stay whole on every rank under ZeRO-3."""


def _zero3_supported(ds_config: Mapping[str, Any], cfg) -> None:
    """ZeRO-3's limits here, from the config alone (measured with DeepSpeed 0.19.8 on CPU)."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("reduce_scatter", True):
        raise Unsupported(
            "ZeRO-3's default reduce_scatter path averages grads over the whole sequence-data-parallel world "
            "(reduce_scatter_coalesced divides by world size; stage3.py __avg_scatter_grads), while its all-reduce "
            "path, ZeRO 0/1/2 and the engine divide by world / sequence_parallel_size: the same loss gets grads "
            "1/sp of ZeRO-2's (measured: 0.5x at SP 2). Set zero_optimization.reduce_scatter: false")
    threshold = zero.get("stage3_param_persistence_threshold", ZERO3_PERSISTENCE_DEFAULT)
    largest = max(known(cfg.vocab, "vocab"), max(64, known(cfg.seq_len, "seq_len")), known(cfg.ffn, "ffn"),
                  known(cfg.hidden, "hidden")) * known(cfg.hidden, "hidden")
    if largest > threshold:
        raise Unsupported(f"ZeRO-3 partitions every param above stage3_param_persistence_threshold ({threshold}) "
                          f"between forwards (the largest here has {largest} elements): the harness reads whole "
                          f"params, which ZeRO-3 only gathers inside forward")


def ds_step_case(name: str, ds_config: Mapping[str, Any] | None = None, *,
                 step: DeepSpeedStepConfig = DeepSpeedStepConfig(), **case_fields: Any) -> Case:
    """A `ulysses_case` (same model, reference and side-by-side checks) whose training step is
    DeepSpeed's engine driven as its users drive it, configured by `ds_config` (DeepSpeed's config
    dict: `zero_optimization` stage 0/1/2, `offload_optimizer`, ...; the run fills in batch size,
    accumulation, clipping and bf16); it declares the token-mean loss ignoring -100.
    `case_fields`: as `ulysses_case`'s."""
    ds_config = dict(ds_config or {})
    stage, offload = _zero(ds_config)
    if step.regress and not (offload and stage in (1, 2)):
        raise ValueError(f"regress {list(step.regress)} reverts ZeRO-1/2 CPU-offload code: needs "
                         f"zero_optimization stage 1 or 2 with offload_optimizer, got stage {stage}, offload {offload}")
    base = ulysses_case(name, **case_fields)

    def validate(cfg) -> None:
        if cfg.dtype not in ("float32", "bfloat16"):
            raise Unsupported(f"DeepSpeed's engine reduces grads only in its accelerator's supported_dtypes (float32, "
                              f"bfloat16, float16 where supported; 'attempting to reduce an unsupported grad type: "
                              f"torch.float64'), and this step runs float32 or bfloat16, not {cfg.dtype}")
        base.validate(cfg)
        if stage == 3:
            _zero3_supported(ds_config, cfg)

    return dataclasses.replace(
        base, validate=validate, train_loss=TrainLoss(ignore_index=IGNORE_INDEX), shard=ds_step_shard(ds_config, step),
        description=f"{base.description}; DeepSpeed's engine step (ZeRO {stage}{', CPU offload' if offload else ''}, "
                    f"{step.boundary} boundary)")


__all__ = ["DeepSpeedStepConfig", "DeepSpeedTrainStep", "REGRESSIONS", "ds_step_case", "ds_step_shard",
           "engine_config", "regressed"]
