"""Stage: step. The Hugging Face transformers `Trainer`'s own training step
as a system under test, judged by the training-step check (`sp-harness check --train-step`).

    from sp_harness.cases.frameworks.hf.case import HFTrainerSetup, hf_trainer_case
    MY_TRAINER = hf_trainer_case("my-trainer", HFTrainerSetup(model="qwen2", trainer_class=MyTrainer))

- The model is a tiny HF causal LM (`LlamaForCausalLM` or `Qwen2ForCausalLM`, `TINY_CONFIG` with
  the run's shapes), float64 on one device for the reference, in the run dtype on every rank.
- Each rank builds a `transformers.Trainer` (or the user's subclass) over its copy with
  `TrainingArguments` from the check's config: `gradient_accumulation_steps` = K,
  `average_tokens_across_devices` (where the release has it), `max_grad_norm` = the clip (0:
  none), a constant schedule, SGD (momentum 0.9) through `optimizers=` or AdamW through
  `optim="adamw_torch"` (weight decay on every param: `get_decay_parameter_names` returns them
  all). The Trainer's own set-up wraps the model in DDP over the harness's gloo world
  (accelerate's MULTI_CPU) and builds the optimizer and scheduler.
- `TrainerStep` (sp_harness.cases.frameworks.hf.step) runs one optimizer step of the installed
  release's own loop, the shape `compat.trainer_loop()` names (transformers 4.45's per-batch
  `accelerator.accumulate`, 4.46 to 5.2's inline `get_batch_samples` loop, 5.3 on's `_run_epoch`):
  the token count over the K micro-batches (gathered over the ranks), `training_step` per
  micro-batch under `accelerator.no_sync` but for the last, the loop's tr_loss sum (with its NaN
  filter), then the clipping and the norm, `optimizer.step()`, `lr_scheduler.step()`,
  `model.zero_grad()`, the callbacks and `_maybe_log_save_evaluate` (the log every step). The
  loss it reports is what that log reports: the ranks' tr_loss gathered and averaged, per step.
  `zero_grad` drops an accumulation without stepping (the invariance checks' second run from the
  same params): the grads, and the loop's running tr_loss, micro-batch index and flos.
- Releases: `compat.RELEASES` (transformers 4.45.0 to 5.23.0, accelerate 0.26.0 to 1.15.0);
  `validate` asks `releases.require`, so a release outside it, or an API the step calls missing,
  is UNSUPPORTED before any rank starts; a user's code that needs what the installed release
  lacks (`compute_loss_func`, a `compute_loss` that takes `num_items_in_batch` on 4.45) is
  UNSUPPORTED on the ranks, naming it.
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
- SP > 1 (world size / dp): the Trainer over accelerate's ParallelismConfig(sp_backend="deepspeed"),
  DeepSpeed's Ulysses (sp_harness.cases.frameworks.hf.sp, docs/frameworks/hf-trainer.md); K must be
  a multiple of SP. Not supported: accelerate's CP (FSDP2 on CUDA), TP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sp_harness import Batch, Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.common import GPT_DEFAULTS, known
from sp_harness.cases.frameworks import releases
from sp_harness.cases.frameworks.hf.step import PLAIN_TRAINER, TrainerFlavour, TrainerStep, launcher_env
from sp_harness.config.step_protocol import TrainLoss
from sp_harness.reference.gpt import token_loss_sum

TRANSFORMERS_VERSION = "5.23.0"
ACCELERATE_VERSION = "1.15.0"
"""The releases the `hf` extra pins, the newest of the supported range (`compat.RELEASES`: the
step follows whichever release of the range is installed)."""

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
    zero_stage: int = 1
    """Under SP (world size / dp > 1, the Trainer over DeepSpeed's Ulysses through accelerate's
    ParallelismConfig): the DeepSpeed config's ZeRO stage, 0, 1 or 2 (3 shards the params, which
    the check cannot map). Unused at SP 1 (the Trainer's DDP)."""
    label_smoothing: float = 0.0
    """The Trainer's `label_smoothing_factor` (its `LabelSmoother`: epsilon spread uniformly over
    every class, torch's convention), 0 <= x < 1; the reference's loss smooths the same."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"HFTrainerSetup.model {self.model!r} is not one of {', '.join(MODELS)}")
        if self.max_pad < 0:
            raise ValueError(f"HFTrainerSetup.max_pad must be >= 0, got {self.max_pad}")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"HFTrainerSetup.zero_stage {self.zero_stage} is not one of 0, 1, 2")
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


def hf_trainer_shard(setup: HFTrainerSetup = HFTrainerSetup(),
                     flavour: TrainerFlavour = PLAIN_TRAINER) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory of a `hf_trainer_case`: this rank's copy of the LM with a `TrainerStep`
    of `flavour`'s Trainer (transformers' own; TRL's SFTTrainer: sp_harness.cases.frameworks.trl)."""

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        step = TrainerStep(reference.get_submodule("lm"), ctx, setup, flavour)
        io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)
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


def _sp_supported(cfg, sp: int) -> None:
    """Unsupported, naming why, where the run's SP > 1 cannot go through the Trainer's SP path
    (accelerate's ParallelismConfig over DeepSpeed's Ulysses: sp_harness.cases.frameworks.hf.sp)."""
    gaps = releases.probe("sp_harness.cases.frameworks.hf.compat", "sp_missing")
    if gaps:
        raise Unsupported(f"the Trainer's sequence parallelism (accelerate's ParallelismConfig, sp_backend "
                          f"'deepspeed') needs {'; '.join(gaps)}")
    k = cfg.micro_batches or 1
    if k % sp:
        raise Unsupported(f"{k} micro-batches at SP {sp}: DeepSpeed's SP data-loader adapter draws one batch from "
                          f"each of the SP ranks per round, so an optimizer step's micro-batches (gradient_accumulation"
                          f"_steps) must be a multiple of SP")


PRELOAD = ("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2", "transformers.trainer")
"""The two models and the Trainer (which imports accelerate, datasets and pyarrow: pyarrow's
jemalloc thread is off in a fork server, zygote_server.ARROW_JEMALLOC_ENV)."""


def _setup() -> None:
    """Per process where no fork server preloaded it (a GPU pool's ranks): the Trainer."""
    import transformers.trainer  # noqa: F401


def hf_trainer_case(name: str, setup: HFTrainerSetup = HFTrainerSetup(), *, flavour: TrainerFlavour = PLAIN_TRAINER,
                    **case_fields: Any) -> Case:
    """A `Case` checking the transformers Trainer's own training step (`setup`'s model and Trainer
    code) over the run's DP ranks against the same HF model in float64 on one device, under the
    training-step check (`--train-step`; the side-by-side check runs the engine's step, not the
    Trainer's, and is Unsupported). `flavour`: which Trainer (TRL's SFTTrainer:
    sp_harness.cases.frameworks.trl.case). `case_fields`: any other `Case` field."""
    case_fields.setdefault("setup", _setup)
    case_fields.setdefault("preload", PRELOAD)
    case_fields.setdefault("isolation", "hf-trainer")

    def validate(cfg) -> None:
        releases.require("sp_harness.cases.frameworks.hf.compat", name)
        if not cfg.train_step:
            raise Unsupported("this case checks the transformers Trainer's own training step: run the training-step "
                              "check (--train-step); the side-by-side check would run the engine's step instead")
        sp = cfg.world_size // cfg.dp
        if sp > 1:
            _sp_supported(cfg, sp)
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
    installed = {d: releases.installed_release(d) or "(not installed)" for d in ("transformers", "accelerate")}
    return Case(name=name, description=f"transformers {installed['transformers']} Trainer's own training step "
                                       f"({setup.model}, DDP over accelerate {installed['accelerate']})",
                build_reference=lambda cfg: build_lm(setup, cfg, torch.float64), make_batch=make_batch(setup),
                shard=hf_trainer_shard(setup, flavour), tokens=shifted_tokens,
                loss_sum=smoothed_shifted_loss_sum(setup.label_smoothing) if setup.label_smoothing else shifted_loss_sum,
                input_layout=Layout(seq_dim=1, batch_dim=0, seq_sharded=False), validate=validate, defaults=defaults,
                train_loss=TrainLoss(ignore_index=IGNORE_INDEX),
                tags=("transformers", "hf-trainer", "framework", "train-step", *case_fields.pop("tags", ())),
                **case_fields)


__all__ = ["ACCELERATE_VERSION", "HFTrainerSetup", "IGNORE_INDEX", "TINY_CONFIG", "TRANSFORMERS_VERSION",
           "CausalLMLogits", "TrainerStep", "hf_trainer_case", "hf_trainer_shard", "launcher_env", "shifted_loss_sum",
           "shifted_tokens", "smoothed_shifted_loss_sum"]
