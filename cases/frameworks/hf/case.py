"""Stage: step. The Hugging Face transformers `Trainer`'s own training step
as a system under test, judged by the training-step check (`sp-harness check --train-step`).

    from sp_harness.cases.frameworks.hf.case import HFTrainerSetup, hf_trainer_case
    MY_TRAINER = hf_trainer_case("my-trainer", HFTrainerSetup(model="qwen2", trainer_class=MyTrainer))

- The model is a tiny HF causal LM (`LlamaForCausalLM` or `Qwen2ForCausalLM`, `TINY_CONFIG` with
  the run's shapes), float64 on one device for the reference, in the run dtype on every rank.
- Each rank builds a `transformers.Trainer` (or the user's subclass) over its copy with
  `TrainingArguments` from the check's config: `gradient_accumulation_steps` = K,
  `average_tokens_across_devices`, `max_grad_norm` = the clip (0: none), a constant schedule,
  SGD (momentum 0.9) through `optimizers=` or AdamW through `optim="adamw_torch"` (weight decay
  on every param: `get_decay_parameter_names` returns them all). The Trainer's own
  `_prepare_for_training` wraps the model in DDP over the harness's gloo world (accelerate's
  MULTI_CPU) and builds the optimizer and scheduler.
- `TrainerStep` runs one optimizer step of `Trainer._inner_training_loop` (its `_run_epoch` body,
  trainer.py 5.23.0 lines 1873-1961): `get_batch_samples` (num_items_in_batch over the K
  micro-batches, gathered over the ranks), `training_step` per micro-batch under
  `accelerator.no_sync` but for the last, the loop's tr_loss sum (with its NaN filter), then
  `_clip_grad_norm` / `_get_grad_norm`, `optimizer.step()`, `lr_scheduler.step()`,
  `model.zero_grad()`, the callbacks and `_maybe_log_save_evaluate` (the log every step). The
  loss it reports is what that log reports: the ranks' tr_loss gathered and averaged
  (`nested_gather(tr_loss).mean()`, trainer.py 2249), per step. `zero_grad` drops an
  accumulation without stepping (the invariance checks' second run from the same params): the
  grads, and the loop's running tr_loss, micro-batch index and flos, which only the log resets.
- Labels: the engine's target IS HF's `labels` (input_ids with -100 on the prompt and the right
  padding); HF's causal LMs shift them inside (`ForCausalLMLoss`: logits[:, t] predicts
  labels[:, t + 1]) and the Trainer counts `labels[..., 1:]`. The case's loss is the same
  shifted sum (`shifted_loss_sum`) over the same count (`shifted_tokens`), so the reference's
  token mean and the Trainer's are one quantity.
- CPU: nothing is shimmed. Launcher environment only (`launcher_env`): accelerate's PartialState
  reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them (the harness's
  ranks start without them) and finds torch.distributed already initialised over gloo, which it
  then uses; OMP_NUM_THREADS is set to the rank's own thread count where unset, or accelerate
  resets it. A printing callback (`PrinterCallback`) is removed: it only prints the log.
- float32, bfloat16 and float64 params (no autocast: `bf16=False`, the model is cast). At every
  dtype HF's `ForCausalLMLoss` computes `logits.float()` and the loop sums the reported loss into
  a float32 `torch.tensor(0.0)`: float32 islands the check finds in the traced run and bounds.
- Not supported: TP / SP > 1 (this integration is the Trainer's DDP over every rank; accelerate's
  ParallelismConfig SP backend is DeepSpeed's and its CP needs FSDP2 on CUDA: not attempted).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sp_harness import Batch, Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.common import GPT_DEFAULTS, known
from sp_harness.config.step_protocol import MicroBatch, TrainLoss
from sp_harness.reference.gpt import token_loss_sum
from sp_harness.step.optim_ref import ADAMW_BETAS, ADAMW_EPS, WEIGHT_DECAY, make_optimizer

TRANSFORMERS_VERSION = "5.23.0"
ACCELERATE_VERSION = "1.15.0"
"""The releases this module is tested with (the `hf` extra pins them)."""

IGNORE_INDEX = -100
PAD_ID = 0
"""The pad token (input_ids of the right padding; attention_mask 0 and labels -100 there)."""

TINY_CONFIG: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   initializer_range=0.2, tie_word_embeddings=False, pad_token_id=PAD_ID)
"""A tiny causal-LM config; initializer_range 0.2 so the logits are far from uniform at init."""

MODELS = ("llama", "qwen2")


@dataclass(kw_only=True, frozen=True)
class HFTrainerSetup:
    """What a `hf_trainer_case` trains: the model and the user's Trainer code."""

    model: str = "llama"
    """'llama' (LlamaForCausalLM) or 'qwen2' (Qwen2ForCausalLM)."""
    model_config: Mapping[str, Any] = field(default_factory=dict)
    """Keywords over `TINY_CONFIG` for the model's config class (the run's shapes override both)."""
    trainer_class: type | None = None
    """A `transformers.Trainer` subclass whose overrides (compute_loss, training_step, ...) run as
    written; or a plain class of such methods, mixed in before `transformers.Trainer` on the rank
    (a case module then need not import transformers). None: `transformers.Trainer`."""
    compute_loss_func: Callable[..., torch.Tensor] | None = None
    """The Trainer's `compute_loss_func(outputs, labels, num_items_in_batch=...)`; None: the
    model's own loss."""
    max_pad: int = 3
    """Each sequence ends in 0..max_pad pad tokens (attention_mask 0, labels -100)."""
    label_smoothing: float = 0.0
    """The Trainer's `label_smoothing_factor` (its `LabelSmoother`: epsilon spread uniformly over
    every class, torch's convention), 0 <= x < 1; the reference's loss smooths the same."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"HFTrainerSetup.model {self.model!r} is not one of {', '.join(MODELS)}")
        if self.max_pad < 0:
            raise ValueError(f"HFTrainerSetup.max_pad must be >= 0, got {self.max_pad}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"HFTrainerSetup.label_smoothing {self.label_smoothing}: needs 0 <= x < 1")


class CausalLMLogits(nn.Module):
    """An HF causal LM called on named tensors, returning its logits (B, S, V): what the harness
    judges. The LM's params keep their names under `lm.`; the Trainer trains `lm` itself."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def shifted_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM token-loss sum: logits[:, t] against labels[:, t + 1], -100 ignored."""
    return token_loss_sum(logits[:, :-1], labels[:, 1:])


def smoothed_shifted_loss_sum(epsilon: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`shifted_loss_sum` with label smoothing `epsilon` (the Trainer's LabelSmoother per token:
    (1 - epsilon) x nll + epsilon x the mean of -log p over the vocabulary)."""
    from sp_harness.cases.frameworks.token_loss import TokenLoss, loss_sum

    loss = TokenLoss(label_smoothing=epsilon, ignore_index=IGNORE_INDEX)
    return lambda logits, labels: loss_sum(loss, logits[:, :-1], labels[:, 1:])


def shifted_tokens(labels: torch.Tensor) -> int:
    """The tokens that carry loss under HF's shift: labels[..., 1:] != -100 (the Trainer's
    `_get_num_items_in_batch` count)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def build_lm(setup: HFTrainerSetup, cfg, dtype: torch.dtype) -> CausalLMLogits:
    """The tiny causal LM of `setup` at the run's shapes, seeded by `cfg.seed` (global RNG kept)."""
    import transformers

    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[setup.model]
    shapes = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
                  max_position_embeddings=max(64, known(cfg.seq_len, "seq_len")))
    config = config_cls(**{**TINY_CONFIG, **setup.model_config, **shapes}, attn_implementation="sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        return CausalLMLogits(model_cls(config).to(dtype))


def launcher_env(ctx: RankContext) -> None:
    """What torchrun sets and accelerate's PartialState reads to find its MULTI_CPU world (it
    then uses the harness's already-initialised gloo group); OMP_NUM_THREADS as this rank runs,
    where unset, or PartialState resets the rank's thread count."""
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank),
                      LOCAL_WORLD_SIZE=str(ctx.world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def trainer_class(user: type | None, optimizer: str) -> type:
    """The Trainer class a rank builds: the user's (a subclass, or a mixin put before
    transformers.Trainer), with weight decay on every param where AdamW is the Trainer's own
    (the engine's AdamW decays biases and norms too; the Trainer exempts them by name)."""
    from transformers import Trainer

    base = Trainer if user is None else user if issubclass(user, Trainer) else type(user.__name__, (user, Trainer), {})
    if optimizer != "adamw":
        return base

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        return [name for name, _ in model.named_parameters()]

    return type(base.__name__, (base,), {"get_decay_parameter_names": get_decay_parameter_names})


class TrainerStep:
    """One optimizer step of the Trainer's own loop on this rank (a `TrainStep`)."""

    def __init__(self, lm: nn.Module, ctx: RankContext, setup: HFTrainerSetup):
        from transformers import PrinterCallback, TrainingArguments

        config = ctx.config
        assert config.optimizer is not None and config.lr is not None, "the check resolves optimizer and lr"
        launcher_env(ctx)
        # the pool's own temporary folder (TMPDIR): the Trainer writes nothing there with saving off
        args = TrainingArguments(
            output_dir=tempfile.gettempdir(), per_device_train_batch_size=known(config.batch, "batch"),
            gradient_accumulation_steps=config.micro_batches, learning_rate=config.lr,
            lr_scheduler_type="constant", max_grad_norm=config.clip_grad_norm or 0.0,
            optim="adamw_torch", adam_beta1=ADAMW_BETAS[0], adam_beta2=ADAMW_BETAS[1], adam_epsilon=ADAMW_EPS,
            weight_decay=WEIGHT_DECAY, average_tokens_across_devices=True, use_cpu=True, ddp_backend="gloo",
            report_to="none", logging_steps=1, save_strategy="no", eval_strategy="no", disable_tqdm=True,
            seed=config.seed, max_steps=known(config.steps, "steps"), label_smoothing_factor=setup.label_smoothing)
        # SGD through `optimizers=`, AdamW the Trainer's own (`optim`): each as a user sets it
        sgd = make_optimizer("sgd", config.lr, lm.parameters()) if config.optimizer == "sgd" else None
        cls = trainer_class(setup.trainer_class, config.optimizer)
        self.trainer = t = cls(model=lm, args=args, optimizers=(sgd, None), compute_loss_func=setup.compute_loss_func)
        t.remove_callback(PrinterCallback)
        # train()'s and _inner_training_loop's set-up (trainer.py 5.23.0 lines 1480, 1592-1671), no dataloader:
        # the engine hands each rank its micro-batches
        t.is_in_train = True
        t._train_batch_size = args.train_batch_size
        max_steps = args.max_steps
        t._init_training_state(max_steps, max_steps, 1, None, None)
        self.model, _ = t._prepare_for_training(max_steps, None, None)
        t._tr_loss = torch.tensor(0.0, device=args.device)
        t._total_loss_scalar = 0.0
        t._globalstep_last_logged = t.state.global_step
        t._initial_global_step = t.state.global_step
        self.model.zero_grad()
        t.control = t.callback_handler.on_train_begin(args, t.state, t.control)
        t.control = t.callback_handler.on_epoch_begin(args, t.state, t.control)
        self.steps_in_epoch = max_steps * args.gradient_accumulation_steps
        self.step_index = -1
        inner = getattr(t.optimizer, "optimizer", t.optimizer)
        # the torch optimizer over the model's own params, whose state the engine reads
        self.optimizer = inner
        self._step_begun = (self.step_index, t.current_flos)

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> float:
        from transformers.trainer import DistributedType  # accelerate's, as trainer.py imports it
        from transformers.trainer_pt_utils import nested_gather

        t, args, model = self.trainer, self.trainer.args, self.model
        batches = [{**mb.inputs, "labels": mb.target} for mb in micro_batches]
        self._step_begun = (self.step_index, t.current_flos)
        if len(batches) < args.gradient_accumulation_steps:
            # the Trainer hands fewer than gradient_accumulation_steps micro-batches only to an
            # epoch's last optimizer step (its `remainder`): ending the epoch here makes the last
            # one a sync step, as there, so accelerate does not skip the optimizer step after it
            self.steps_in_epoch = self.step_index + 1 + len(batches)
        # trainer.py 5.23.0 lines 1873-1926 and 1960-1961, verbatim but `self` -> `t`, `step` -> `self.step_index`
        batch_samples, num_items_in_batch = t.get_batch_samples(iter(batches), len(batches), args.device)
        t.current_gradient_accumulation_steps = len(batch_samples)
        for i, inputs in enumerate(batch_samples):
            self.step_index += 1
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
            if args.logging_nan_inf_filter and (torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)):
                t._tr_loss += t._tr_loss / (1 + t.state.global_step - t._globalstep_last_logged)
            else:
                t._tr_loss += tr_loss_step
            t.current_flos += float(t.floating_point_ops(inputs))
            t._track_num_input_tokens(inputs)
            if not do_sync_step:
                t.control = t.callback_handler.on_substep_end(args, t.state, t.control)
        # what the step's log will report (trainer.py 2249, 2255: gathered, averaged, per step)
        gathered = nested_gather(t._tr_loss.detach().clone(), args.parallel_mode)
        return gathered.mean().item() / (t.state.global_step + 1 - t._globalstep_last_logged)

    def zero_grad(self) -> None:
        """This optimizer step's accumulation dropped without stepping (the invariance checks run
        a second one from the same params): the grads, as the loop's `model.zero_grad()` after a
        step, and the loop's running sums, which only the step's log resets (`tr_loss -= tr_loss`
        in `_maybe_log_save_evaluate`): kept, the next accumulation would report the dropped
        one's loss plus its own, and run as the next micro-batches of the epoch."""
        self.model.zero_grad()
        self.trainer._tr_loss.zero_()
        self.step_index, self.trainer.current_flos = self._step_begun

    def grad_norm(self) -> torch.Tensor:
        """The Trainer's own unclipped norm (`_get_grad_norm`: accelerate's clip_grad_norm_ at an
        infinite max norm, a coefficient of exactly 1)."""
        return self.trainer._get_grad_norm(self.model)

    def step(self) -> torch.Tensor:
        from transformers.optimization import GreedyLR

        t, args, model = self.trainer, self.trainer.args, self.model
        # trainer.py 5.23.0 lines 1928-1959, verbatim but `self` -> `t`, `step` -> `self.step_index`, epoch 0,
        # trial and eval keys None, start_time 0 (the log's throughput figures only)
        grad_norm = None
        if args.max_grad_norm > 0:
            grad_norm = t._clip_grad_norm(model)
        grad_norm = t._get_grad_norm(model, grad_norm=grad_norm)
        t.control = t.callback_handler.on_pre_optimizer_step(args, t.state, t.control)
        t.optimizer.step()
        t.control = t.callback_handler.on_optimizer_step(args, t.state, t.control)
        learning_rate = t._get_learning_rate()
        if not t.accelerator.optimizer_step_was_skipped:
            if not isinstance(t.lr_scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)):
                t.lr_scheduler.step()
        model.zero_grad()
        t.state.global_step += 1
        t.state.epoch = (self.step_index + 1) / self.steps_in_epoch
        t.control = t.callback_handler.on_step_end(args, t.state, t.control)
        t._maybe_log_save_evaluate(t._tr_loss, grad_norm, model, None, 0, None, 0.0, learning_rate=learning_rate)
        return grad_norm


def hf_trainer_shard(setup: HFTrainerSetup = HFTrainerSetup()) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory of a `hf_trainer_case`: this rank's copy of the LM with a `TrainerStep`."""

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        step = TrainerStep(reference.get_submodule("lm"), ctx, setup)
        io = Layout(seq_dim=1, batch_dim=0)
        return Sharded(module=reference, input_layout=io, output_layout=io, replicated=("*",), train_step=step)

    return shard


def make_batch(setup: HFTrainerSetup):
    """(config, step, generator) -> padded, prompt-masked sequences: input_ids (dp * batch, S) with
    PAD_ID on each row's right padding, attention_mask, and labels = input_ids with -100 on the
    prompt (`prompt_len`, at least the first token, which HF's shift never predicts) and the pads."""

    def made(cfg, step: int, gen: torch.Generator) -> Batch:
        rows, length = cfg.dp * known(cfg.batch, "batch"), known(cfg.seq_len, "seq_len")
        ids = torch.randint(1, known(cfg.vocab, "vocab"), (rows, length), generator=gen)
        pads = torch.randint(0, min(setup.max_pad, length - 2) + 1, (rows,), generator=gen)
        mask = (torch.arange(length) < (length - pads)[:, None]).long()
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, PAD_ID))
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE_INDEX))
        labels[:, : max(1, cfg.prompt_len or 0)] = IGNORE_INDEX
        return Batch(inputs={"input_ids": ids, "attention_mask": mask}, target=labels)

    return made


def _setup() -> None:
    """Per process: transformers' Trainer (which imports accelerate); not a preload, since its
    import starts a thread, which a fork server must not have. The two models are preloaded."""
    import transformers.trainer  # noqa: F401


def hf_trainer_case(name: str, setup: HFTrainerSetup = HFTrainerSetup(), **case_fields: Any) -> Case:
    """A `Case` checking the transformers Trainer's own training step (`setup`'s model and Trainer
    code) over the run's DP ranks against the same HF model in float64 on one device, under the
    training-step check (`--train-step`; the side-by-side check runs the engine's step, not the
    Trainer's, and is Unsupported). `case_fields`: any other `Case` field."""
    case_fields.setdefault("setup", _setup)
    case_fields.setdefault("preload", ("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2"))
    case_fields.setdefault("isolation", "hf-trainer")

    def validate(cfg) -> None:
        if not cfg.train_step:
            raise Unsupported("this case checks the transformers Trainer's own training step: run the training-step "
                              "check (--train-step); the side-by-side check would run the engine's step instead")
        if cfg.world_size != cfg.dp:
            raise Unsupported(f"the Trainer here is DDP over every rank (dp = world size): this run has TP/SP "
                              f"{cfg.world_size // cfg.dp} (world size {cfg.world_size}, dp {cfg.dp}); accelerate's "
                              f"ParallelismConfig SP backend is DeepSpeed's and its CP needs FSDP2 on CUDA")
        if cfg.seq_len < 3:
            raise ValueError(f"seq_len {cfg.seq_len}: HF's shifted loss needs at least 3 tokens (a prompt token and "
                             f"two that carry loss)")
        if cfg.hidden % cfg.num_heads or cfg.num_heads % (cfg.num_kv_heads or cfg.num_heads):
            raise ValueError(f"num_heads({cfg.num_heads}) must divide hidden({cfg.hidden}) and num_kv_heads"
                             f"({cfg.num_kv_heads}) num_heads")
        if cfg.layout not in (None, "bsh") or cfg.causal is False:
            raise Unsupported("an HF causal LM takes [b, s] token ids and is causal")

    config = {**TINY_CONFIG, **setup.model_config}
    shapes = dict(vocab=config["vocab_size"], hidden=config["hidden_size"], ffn=config["intermediate_size"],
                  num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
                  num_kv_heads=config["num_key_value_heads"])
    defaults = {**GPT_DEFAULTS, **shapes, "dtype": "float32", "prompt_len": 2,
                **case_fields.pop("defaults", {})}
    return Case(name=name, description=f"transformers {TRANSFORMERS_VERSION} Trainer's own training step "
                                       f"({setup.model}, DDP over accelerate {ACCELERATE_VERSION})",
                build_reference=lambda cfg: build_lm(setup, cfg, torch.float64), make_batch=make_batch(setup),
                shard=hf_trainer_shard(setup), tokens=shifted_tokens,
                loss_sum=smoothed_shifted_loss_sum(setup.label_smoothing) if setup.label_smoothing else shifted_loss_sum,
                input_layout=Layout(seq_dim=1, batch_dim=0), validate=validate, defaults=defaults,
                train_loss=TrainLoss(ignore_index=IGNORE_INDEX),
                tags=("transformers", "hf-trainer", "framework", "train-step", *case_fields.pop("tags", ())),
                **case_fields)


__all__ = ["ACCELERATE_VERSION", "HFTrainerSetup", "IGNORE_INDEX", "TINY_CONFIG", "TRANSFORMERS_VERSION",
           "CausalLMLogits", "TrainerStep", "hf_trainer_case", "hf_trainer_shard", "launcher_env", "shifted_loss_sum",
           "shifted_tokens", "smoothed_shifted_loss_sum"]
