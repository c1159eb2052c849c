"""Stage: step. `TrainerStep`: one optimizer step of the installed transformers Trainer's own
loop, in the three parts the training-step check calls (`accumulate`, `grad_norm`, `step`).

The loop is a loop over a dataloader with the optimizer step inside it; the check reads the grads
between the accumulation and the step, so the step replays the loop's body, line for line, in
two halves, calling the release's own methods wherever the loop calls one (`training_step`,
`compute_loss`, `get_batch_samples`, `_clip_grad_norm`, `_maybe_log_save_evaluate`, the
callbacks, accelerate's `accumulate` / `no_sync` / `clip_grad_norm_`): a bug of the installed
release runs as it shipped. Which body it replays is the installed Trainer's loop shape
(`compat.trainer_loop()`), cited by release and line below:

- `RUN_EPOCH` (5.3 on): `_init_training_state` + `_prepare_for_training`, then `_run_epoch`'s body
  (trainer.py 5.23.0 lines 1873-1961).
- `BATCH_SAMPLES` (4.46 to 5.2): `_inner_training_loop`'s set-up and loop body, inline (trainer.py
  4.46.3 lines 2213-2382 and 2424-2550, 4.57.1 lines 2416-2573 and 2615-2767):
  `get_batch_samples`, `training_step(model, inputs, num_items_in_batch)`,
  `accelerator.clip_grad_norm_`.
- `ACCUMULATE` (4.45): the same set-up, then one batch at a time under `accelerator.accumulate`,
  `training_step(model, inputs)`, the step where `total_batched_samples % K == 0` (trainer.py
  4.45.2 lines 2142-2311 and 2345-2469).

What the replay leaves out is what these runs never reach: resuming from a checkpoint,
DeepSpeed, FSDP, SageMaker, apex, XLA, `include_num_input_tokens_seen` (off), evaluation and
saving (off). Where two releases of one shape word a line differently with the same effect on
DDP (4.46.x's `total_batched_samples` sync rule and 4.47's `(step + 1) % K`, over one epoch of
full accumulations; 5.2's `sync_each_batch` sync context and 4.46's `i != last`, with
`sync_each_batch` off), the step writes the later one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from sp_harness import RankContext, Unsupported
from sp_harness.cases.common import known
from sp_harness.cases.frameworks.hf import compat
from sp_harness.cases.frameworks.hf import sp as sp_path
from sp_harness.config.step_protocol import MicroBatch
from sp_harness.step.optim_ref import ADAMW_BETAS, ADAMW_EPS, SGD_MOMENTUM, WEIGHT_DECAY, make_optimizer


def launcher_env(ctx: RankContext) -> None:
    """What torchrun sets and accelerate's PartialState reads to find its MULTI_CPU world (it
    then uses the harness's already-initialised gloo group); OMP_NUM_THREADS as this rank runs,
    where unset, or PartialState resets the rank's thread count."""
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank),
                      LOCAL_WORLD_SIZE=str(ctx.world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


class TrainerFlavour(Protocol):
    """Which Trainer a `TrainerStep` runs and what its dataloader yields: the Trainer itself
    (`PLAIN_TRAINER`) or a library's subclass with its own arguments, dataset preparation and
    collator (TRL's `SFTTrainer`: sp_harness.cases.frameworks.trl.case). Everything else, the
    loop, the SP path and the reading of grads, is the Trainer's and the same for every flavour."""

    def base(self) -> type:
        """The Trainer class the user's code (`HFTrainerSetup.trainer_class`) extends."""
        ...

    def build(self, cls: type, lm: nn.Module, arguments: dict[str, Any], optimizers: tuple, extra: dict[str, Any]) -> Any:
        """The trainer over `lm`: `cls` (a subclass of `base()`) with `arguments` as the
        TrainingArguments keywords a user writes, `optimizers=` and the other `extra` keywords."""
        ...

    def batches(self, trainer: Any, micro_batches: Sequence[MicroBatch], sp: int) -> list[dict[str, Any]]:
        """What this rank's dataloader yields for `micro_batches` (its own, in order) at SP `sp`."""
        ...


class PlainTrainer:
    """`transformers.Trainer` over batches a user's collator makes: the engine's padded batch with
    `labels` under DDP; under SP the collator the SP path needs (`sp.collate`)."""

    def base(self) -> type:
        from transformers import Trainer

        return Trainer

    def build(self, cls: type, lm: nn.Module, arguments: dict[str, Any], optimizers: tuple, extra: dict[str, Any]) -> Any:
        from transformers import TrainingArguments

        return cls(model=lm, args=TrainingArguments(**arguments), optimizers=optimizers, **extra)

    def batches(self, trainer: Any, micro_batches: Sequence[MicroBatch], sp: int) -> list[dict[str, Any]]:
        if sp > 1:
            return [sp_path.collate(mb, sp) for mb in micro_batches]
        return [{**mb.inputs, "labels": mb.target} for mb in micro_batches]


PLAIN_TRAINER = PlainTrainer()


def trainer_class(user: type | None, optimizer: str, base: type | None = None) -> type:
    """The Trainer class a rank builds: the user's (a subclass, or a mixin put before `base`,
    transformers.Trainer by default), with weight decay on every param where AdamW is the Trainer's
    own (the engine's AdamW decays biases and norms too; the Trainer exempts them by name)."""
    if base is None:
        from transformers import Trainer

        base = Trainer
    assert base is not None
    base = base if user is None else user if issubclass(user, base) else type(user.__name__, (user, base), {})
    if optimizer != "adamw":
        return base

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        return [name for name, _ in model.named_parameters()]

    return type(base.__name__, (base,), {"get_decay_parameter_names": get_decay_parameter_names})


def _unsupported_here(setup: Any, cls: Any) -> str | None:
    """Why the installed Trainer cannot run `setup` as written, where it cannot: an argument or a
    token count the user's code relies on that this release does not have."""
    from transformers import Trainer

    release = f"transformers {_installed('transformers')}"
    if setup.compute_loss_func is not None and not compat.takes_compute_loss_func():
        return f"HFTrainerSetup(compute_loss_func=) needs Trainer(compute_loss_func=), which {release} lacks"
    if getattr(cls, "loss_is_scaled_for_ga", None) is True and not compat.reads_loss_is_scaled_for_ga():
        return (f"{cls.__name__} says its loss is already scaled for accumulation (loss_is_scaled_for_ga = True), "
                f"which {release}'s Trainer never reads: its training_step divides that loss by "
                f"gradient_accumulation_steps again wherever the model takes no loss kwargs (under SP, always)")
    overridden = cls.compute_loss is not Trainer.compute_loss
    if (overridden and not compat.passes_num_items_in_batch()
            and "num_items_in_batch" in inspect.signature(cls.compute_loss).parameters):
        return (f"{cls.__name__}.compute_loss takes num_items_in_batch, which {release}'s training_step never "
                f"passes (its loop counts no tokens: it calls compute_loss(model, inputs))")
    return None


def _installed(distribution: str) -> str:
    from sp_harness.cases.frameworks.releases import installed_release

    return installed_release(distribution) or "?"


class TrainerStep:
    """One optimizer step of the installed Trainer's own loop on this rank (a `TrainStep`)."""

    def __init__(self, lm: nn.Module, ctx: RankContext, setup: Any, flavour: TrainerFlavour = PLAIN_TRAINER):
        from transformers import PrinterCallback

        config = ctx.config
        assert config.optimizer is not None and config.lr is not None, "the check resolves optimizer and lr"
        launcher_env(ctx)
        self.loop = compat.trainer_loop()
        # SP > 1: accelerate's ParallelismConfig over DeepSpeed's Ulysses (sp_harness.cases.frameworks.hf.sp)
        self.sp = ctx.tp
        self.ctx = ctx
        sp_path.reset_process(self.sp)
        if self.sp > 1:
            sp_path.prepare_process(ctx)
        # the pool's own temporary folder (TMPDIR): the Trainer writes nothing there with saving off
        arguments: dict[str, Any] = dict(
            output_dir=tempfile.gettempdir(), per_device_train_batch_size=known(config.batch, "batch"),
            gradient_accumulation_steps=config.micro_batches, learning_rate=config.lr,
            lr_scheduler_type="constant", max_grad_norm=config.clip_grad_norm or 0.0,
            optim="adamw_torch", adam_beta1=ADAMW_BETAS[0], adam_beta2=ADAMW_BETAS[1], adam_epsilon=ADAMW_EPS,
            weight_decay=WEIGHT_DECAY, use_cpu=True, ddp_backend="gloo",
            report_to="none", logging_steps=1, save_strategy="no", eval_strategy="no", disable_tqdm=True,
            seed=config.seed, max_steps=known(config.steps, "steps"), label_smoothing_factor=setup.label_smoothing)
        if compat.averages_tokens_across_devices():
            # the token count of every rank's micro-batches (4.46 on; 5.x's default): a release
            # before it counts none, and its loss is the mean of micro-batch means (#34191)
            arguments["average_tokens_across_devices"] = True
        if self.sp > 1:
            arguments.update(sp_path.arguments(ctx, setup.zero_stage))
            if config.optimizer == "sgd":
                # under DeepSpeed the Trainer drops `optimizers=` (deepspeed_init sets trainer.optimizer
                # = None) and builds its own from `optim`: SGD is asked for there, as such a user must
                arguments.update(optim="sgd", optim_args=f"momentum={SGD_MOMENTUM}", weight_decay=0.0)
        # SGD through `optimizers=`, AdamW the Trainer's own (`optim`): each as a user sets it
        sgd = (make_optimizer("sgd", config.lr, lm.parameters())
               if config.optimizer == "sgd" and self.sp == 1 else None)
        cls = trainer_class(setup.trainer_class, config.optimizer, flavour.base())
        reason = _unsupported_here(setup, cls)
        if reason is not None:
            raise Unsupported(reason)
        extra = {} if setup.compute_loss_func is None else {"compute_loss_func": setup.compute_loss_func}
        self.flavour = flavour
        self.trainer = t = flavour.build(cls, lm, arguments, (sgd, None), extra)
        args = t.args
        t.remove_callback(PrinterCallback)
        # train()'s set-up (trainer.py 5.23.0 line 1481), no dataloader: the engine hands each
        # rank its micro-batches
        t.is_in_train = True
        t._train_batch_size = args.train_batch_size
        max_steps = args.max_steps
        self.feed = sp_path.Feed()
        self.model = self._set_up_split(max_steps) if self.loop == compat.RUN_EPOCH else self._set_up_inline(max_steps)
        self.deferred: sp_path.DeferredStep | None = None
        # SP 1 is the Trainer's DDP step, never DeepSpeed's engine (sp_path.reset_process)
        assert self.sp > 1 or not getattr(t, "is_deepspeed_enabled", False), "the DDP Trainer step runs DeepSpeed"
        if self.sp > 1:
            sp_path.check_groups(ctx)
            self.deferred = sp_path.DeferredStep(t.accelerator.deepspeed_engine_wrapped.engine)
            from deepspeed.utils import safe_get_full_grad

            # ZeRO's grads live in its partitions: gathered, a copy (the DeepSpeed step's reader)
            self.grad_of = safe_get_full_grad
        # _inner_training_loop's last lines before the epochs (5.23.0 1647-1653; 4.45.2 2305-2311)
        self.tr_loss = torch.tensor(0.0, device=args.device)
        t._tr_loss = self.tr_loss
        t._total_loss_scalar = 0.0
        t._globalstep_last_logged = t.state.global_step
        t._initial_global_step = t.state.global_step
        self.model.zero_grad()
        t.control = t.callback_handler.on_train_begin(args, t.state, t.control)
        t.control = t.callback_handler.on_epoch_begin(args, t.state, t.control)
        self.steps_in_epoch = max_steps * args.gradient_accumulation_steps
        self.step_index = -1
        self.total_batched_samples = 0
        self.log_parameters = compat.log_parameters()
        self.not_stepped = compat.schedulers_not_stepped()
        self.gather = compat.log_gather(t)
        self.learning_rate: float | None = None
        inner = getattr(t.optimizer, "optimizer", t.optimizer)
        # the torch optimizer over the model's own params, whose state the engine reads; under SP
        # DeepSpeed's (ZeRO partitions, fp32 masters), judged through the float64 shadow instead
        self.optimizer = inner if self.sp == 1 else None
        self._step_begun = self._position()

    def _set_up_split(self, max_steps: int) -> nn.Module:
        """5.3 on: the release's own `_init_training_state` and `_prepare_for_training` (trainer.py
        5.23.0 lines 1612-1615)."""
        t = self.trainer
        t._init_training_state(max_steps, max_steps, 1, None, None)
        # under SP the Trainer wraps its dataloader in DeepSpeed's SP adapter here (5.23.0 line
        # 1798): the feed is that dataloader, its adapter what the loop iterates
        model, loader = t._prepare_for_training(max_steps, self.feed if self.sp > 1 else None, None)
        self.loader = loader
        return model

    def _set_up_inline(self, max_steps: int) -> nn.Module:
        """Before 5.3: `_inner_training_loop`'s set-up, inline there (trainer.py 4.45.2 lines
        2142-2304, 4.57.1 2416-2565, 5.2.0 1475-1634), with no delayed optimizer (no FSDP,
        SageMaker or DeepSpeed) and nothing to resume."""
        from transformers.trainer_callback import ExportableState, TrainerState

        t, args = self.trainer, self.trainer.args
        if t._created_lr_scheduler:
            t.lr_scheduler = None
            t._created_lr_scheduler = False
        after_prepare = compat.scheduler_after_prepare()
        if after_prepare:
            t.create_optimizer()
        else:
            t.create_optimizer_and_scheduler(num_training_steps=max_steps)
        t.state = TrainerState(stateful_callbacks=[
            cb for cb in t.callback_handler.callbacks + [t.control] if isinstance(cb, ExportableState)])
        t.state.is_hyper_param_search = False
        t.state.train_batch_size = t._train_batch_size
        if compat.state_computes_steps():
            t.state.compute_steps(args, max_steps)
        else:
            t.state.logging_steps = args.logging_steps  # logging_steps 1: not a ratio
        model = t._wrap_model(t.model_wrapped)
        if model is t.model:
            t.model.train()
            model, t.optimizer = t.accelerator.prepare(t.model, t.optimizer)
        else:
            t.optimizer = t.accelerator.prepare(t.optimizer)
        if after_prepare:
            t.create_scheduler(num_training_steps=max_steps)
        if model is not t.model:
            t.model_wrapped = model
        t.state.epoch = 0
        if compat.state_inits_references():
            for attr in ("model", "optimizer", "lr_scheduler"):
                setattr(t.callback_handler, attr, getattr(t, attr))
            t.callback_handler.train_dataloader = None
            t.state.init_training_references(t, max_steps, 1, None)
        else:
            t.callback_handler.model = t.model
            t.callback_handler.optimizer = t.optimizer
            t.callback_handler.lr_scheduler = t.lr_scheduler
            t.callback_handler.train_dataloader = None
            t.state.trial_params = None
            t.state.max_steps = max_steps
            t.state.num_train_epochs = 1
            t.state.is_local_process_zero = t.is_local_process_zero()
            t.state.is_world_process_zero = t.is_world_process_zero()
        return model

    def _position(self) -> tuple:
        """Where the loop is, as `zero_grad` rewinds it: micro-batch index, batches seen, flos,
        and accelerate's own accumulation counter (`accumulate` counts in it)."""
        return (self.step_index, self.total_batched_samples, self.trainer.current_flos,
                getattr(self.trainer.accelerator, "step", 0))

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> float:
        t, args = self.trainer, self.trainer.args
        self._step_begun = self._position()
        if self.sp > 1:
            # this SP rank's dataloader batches; the adapter makes the K micro-steps from them
            self.feed.put(self.flavour.batches(t, sp_path.mine(micro_batches, self.ctx), self.sp))
            batches: Any = self.loader
        else:
            batches = self.flavour.batches(t, micro_batches, 1)
        if len(micro_batches) < args.gradient_accumulation_steps:
            # fewer than gradient_accumulation_steps micro-batches come only at an epoch's end
            # (its `remainder`): ending the epoch here makes the last one a sync step, as there;
            # transformers 4.45 steps on fewer than K only in an epoch shorter than K
            if self.loop == compat.ACCUMULATE:
                self.step_index = -1
                self.steps_in_epoch = len(micro_batches)
            else:
                self.steps_in_epoch = self.step_index + 1 + len(micro_batches)
        if self.loop == compat.ACCUMULATE:
            self._accumulate_per_batch(batches)
        else:
            self._accumulate_batch_samples(iter(batches), len(micro_batches))
        # what the step's log will report (trainer.py 5.23.0 2249-2255, 4.45.2 2897-2903: the
        # ranks' tr_loss gathered and averaged, per step since the last log; 4.x rounds it to 4
        # digits in the log, the check takes it unrounded)
        gathered = self.gather(self.tr_loss.detach().clone())
        return gathered.mean().item() / (t.state.global_step + 1 - t._globalstep_last_logged)

    def _accumulate_batch_samples(self, epoch_iterator: Any, count: int) -> None:
        """4.46 on: trainer.py 5.23.0 lines 1873-1926 (4.57.1 2618-2693), but `self` -> `t`,
        `step` -> `self.step_index`."""
        from transformers.trainer import DistributedType  # accelerate's, as trainer.py imports it

        t, args, model = self.trainer, self.trainer.args, self.model
        device = (args.device,) if compat.batch_samples_take_device() else ()
        batch_samples, num_items_in_batch = t.get_batch_samples(epoch_iterator, count, *device)
        # 4.57 on; an attribute no earlier release reads
        t.current_gradient_accumulation_steps = len(batch_samples)
        for i, inputs in enumerate(batch_samples):
            self.step_index += 1
            self.total_batched_samples += 1
            step = self.step_index
            do_sync_step = (step + 1) % args.gradient_accumulation_steps == 0 or (step + 1) == self.steps_in_epoch
            t.accelerator.gradient_state._set_sync_gradients(do_sync_step)
            if step % args.gradient_accumulation_steps == 0:
                t.control = t.callback_handler.on_step_begin(args, t.state, t.control)
            sync_context: Callable[[], contextlib.AbstractContextManager[Any]]
            if (
                t.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
                or t.accelerator.distributed_type == DistributedType.DEEPSPEED
                or i == len(batch_samples) - 1
            ):
                sync_context = contextlib.nullcontext
            else:
                sync_context = functools.partial(t.accelerator.no_sync, model=model)
            with sync_context():
                tr_loss_step = t.training_step(model, inputs, num_items_in_batch)
            self._add_loss(tr_loss_step)
            t.current_flos += float(t.floating_point_ops(inputs))
            if self.loop == compat.RUN_EPOCH:
                t._track_num_input_tokens(inputs)
            if not do_sync_step:
                t.control = t.callback_handler.on_substep_end(args, t.state, t.control)

    def _accumulate_per_batch(self, batches: list[dict]) -> None:
        """4.45: trainer.py 4.45.2 lines 2345-2419 and 2467-2469, but `self` -> `t`, `step` ->
        `self.step_index`; the sync step's body is `step`."""
        t, args, model = self.trainer, self.trainer.args, self.model
        for inputs in batches:
            self.step_index += 1
            self.total_batched_samples += 1
            step = self.step_index
            if step % args.gradient_accumulation_steps == 0:
                t.control = t.callback_handler.on_step_begin(args, t.state, t.control)
            with t.accelerator.accumulate(model):
                tr_loss_step = t.training_step(model, inputs)
            self._add_loss(tr_loss_step)
            t.current_flos += float(t.floating_point_ops(inputs))
            is_last_step_and_steps_less_than_grad_acc = (
                self.steps_in_epoch <= args.gradient_accumulation_steps and (step + 1) == self.steps_in_epoch
            )
            if self.total_batched_samples % args.gradient_accumulation_steps == 0 or is_last_step_and_steps_less_than_grad_acc:
                if is_last_step_and_steps_less_than_grad_acc:
                    t.accelerator.gradient_state._set_sync_gradients(True)
            else:
                t.control = t.callback_handler.on_substep_end(args, t.state, t.control)

    def _add_loss(self, tr_loss_step: torch.Tensor) -> None:
        """The loop's `tr_loss += tr_loss_step`, with its NaN / inf filter (every release: 4.46 to
        5.2 write it `tr_loss = tr_loss + ...`, the same sum)."""
        t, args = self.trainer, self.trainer.args
        if args.logging_nan_inf_filter and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)):
            self.tr_loss += self.tr_loss / (1 + t.state.global_step - t._globalstep_last_logged)
        else:
            self.tr_loss += tr_loss_step

    def zero_grad(self) -> None:
        """This optimizer step's accumulation dropped without stepping (the invariance checks run
        a second one from the same params): the grads, as the loop's `model.zero_grad()` after a
        step, and the loop's running sums, which only the step's log resets (`tr_loss -= tr_loss`
        in `_maybe_log_save_evaluate`): kept, the next accumulation would report the dropped
        one's loss plus its own, and run as the next micro-batches of the epoch."""
        if self.deferred is not None:
            # ZeRO's reduced partitions have no drop-without-step call a user could make
            raise Unsupported("a second accumulation from the same params (the invariance checks) under SP: "
                              "DeepSpeed's engine has no call that drops an accumulated step")
        self.model.zero_grad()
        self.tr_loss.zero_()
        self.step_index, self.total_batched_samples, self.trainer.current_flos, accelerate_step = self._step_begun
        if hasattr(self.trainer.accelerator, "step"):
            self.trainer.accelerator.step = accelerate_step

    def grad_norm(self) -> torch.Tensor | None:
        """The Trainer's own unclipped norm: `_get_grad_norm` (5.3 on), else the loop's clipping
        call, accelerate's `clip_grad_norm_` over `model.parameters()`, at an infinite max norm
        (a coefficient of exactly 1), which is what `_get_grad_norm` runs. None under SP."""
        t = self.trainer
        if self.deferred is not None:
            return None  # DeepSpeed's engine computes its norm inside its boundary step
        if self.loop == compat.RUN_EPOCH:
            return t._get_grad_norm(self.model)
        return t.accelerator.clip_grad_norm_(self.model.parameters(), float("inf"))

    def step(self) -> torch.Tensor:
        t, args, model = self.trainer, self.trainer.args, self.model
        # trainer.py 5.23.0 lines 1928-1959 (4.57.1 2694-2765, 4.45.2 2420-2467), but `self` -> `t`,
        # `step` -> `self.step_index`, epoch 0, trial and eval keys None, start_time 0 (the log's
        # throughput figures only)
        grad_norm = None
        if self.deferred is not None:
            self.deferred.run()  # accelerate's boundary engine.step(), where the last backward called it
        if self.loop == compat.RUN_EPOCH:
            if args.max_grad_norm > 0:
                grad_norm = t._clip_grad_norm(model)
            grad_norm = t._get_grad_norm(model, grad_norm=grad_norm)
        elif args.max_grad_norm is not None and args.max_grad_norm > 0:
            grad_norm = t.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        # the norm the loop logs; where it clips nothing (before 5.3) the log has none, and the
        # step reports the unclipped norm its clipping would compute
        reported = grad_norm if grad_norm is not None else self.grad_norm()
        assert reported is not None, "the Trainer reports DeepSpeed's norm after its boundary step"
        t.control = t.callback_handler.on_pre_optimizer_step(args, t.state, t.control)
        t.optimizer.step()
        t.control = t.callback_handler.on_optimizer_step(args, t.state, t.control)
        learning_rate = t._get_learning_rate()
        if not t.accelerator.optimizer_step_was_skipped:
            if not isinstance(t.lr_scheduler, self.not_stepped):
                t.lr_scheduler.step()
        model.zero_grad()
        t.state.global_step += 1
        t.state.epoch = (self.step_index + 1) / self.steps_in_epoch
        t.control = t.callback_handler.on_step_end(args, t.state, t.control)
        log: dict[str, Any] = {}
        if "start_time" in self.log_parameters:
            log["start_time"] = 0.0
        if "learning_rate" in self.log_parameters:
            log["learning_rate"] = learning_rate
        t._maybe_log_save_evaluate(self.tr_loss, grad_norm, model, None, 0, None, **log)
        return reported
