"""Stage: step. verl's own SFT training step with Ulysses sequence parallelism as a system under
test, judged by the training-step check (`sp-harness check --train-step`).

    from sp_harness.cases.frameworks.verl.case import VerlSFTSetup, verl_sft_case
    MY_SFT = verl_sft_case("my-verl-sft", VerlSFTSetup(model="qwen2"))

- The model is a tiny HF causal LM (`LlamaForCausalLM` or `Qwen2ForCausalLM` at the run's
  shapes: sp_harness.cases.frameworks.hf.case's `build_lm`), float64 on one device for the
  reference. Each rank hands verl its weights in the run dtype as a checkpoint, which verl's
  engine loads itself (`HFModelConfig(path=...)`, rank 0's `from_pretrained`, FSDP2's broadcast).
- The step (`VerlSFTStep`, sp_harness.cases.frameworks.verl.step) is verl 0.9.1's
  `FSDPEngineWithLMHead` (FSDP2 over the world, `ulysses_sequence_parallel_size` = world size /
  dp) driven as `SFTTrainer.fit` -> `TrainingWorker.train_batch` -> `BaseEngine.train_batch`
  drive it: verl's padding removal, Ulysses slicing, patched attention, log-prob gather,
  `sft_loss`, FSDP2's grad reduce-scatter, its clipping and the torch optimizer (SGD momentum 0.9
  or AdamW as optim_ref's) with a constant lr schedule. The loss it reports is
  `TrainingWorker`'s: the micro-batches' losses summed and averaged over the DP group.
- Labels: the engine's target IS HF's `labels` (-100 on the prompt and the right padding);
  verl's loss mask is `labels != -100`, rolled by one inside `sft_loss` (token t + 1's loss from
  position t), and its token count is the DP group's loss-mask sum: the case's loss is the same
  shifted sum (`shifted_loss_sum`) over the same count (`shifted_tokens`). The prompt covers at
  least the first token, so the mask's first entry, which verl counts but never rolls into a
  loss, is always 0.
- CPU: the shims of `shims` (a CPU platform for verl's device layer, an exact stand-in for the
  flash-attn varlen kernel, the attention name that routes transformers through its flash path,
  a guard for trl's value-head import) and nothing else; docs/frameworks/verl.md.
- float32 and bfloat16 params (verl's `model_dtype` and FSDP2's param dtype; reduce in float32,
  verl's default; autocast to bfloat16 in a bfloat16 run, as verl's forward_step does). float64
  is UNSUPPORTED (verl's PrecisionType has no fp64).
- Releases: `compat.RELEASES` (verl 0.9.1); `validate` asks `releases.require`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sp_harness import Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.common import GPT_DEFAULTS
from sp_harness.cases.frameworks import releases
from sp_harness.cases.frameworks.verl.shims import PRELOAD
from sp_harness.config.step_protocol import MicroBatch, TrainLoss

IGNORE_INDEX = -100
PAD_ID = 0
MODELS = ("llama", "qwen2")
ISOLATION = "verl"
"""verl's monkey patches (transformers' flash-attention forward, its platform singleton, its
Ulysses group global) are process-wide: verl's cases share rank processes only with each other."""


@dataclass(kw_only=True, frozen=True)
class VerlSFTSetup:
    """What a `verl_sft_case` trains, and the user code that runs inside verl's step."""

    model: str = "llama"
    """'llama' (LlamaForCausalLM) or 'qwen2' (Qwen2ForCausalLM)."""
    max_pad: int = 3
    """Each sequence of the engine's batch ends in 0..max_pad pad tokens (labels -100), which
    verl's padding removal drops."""
    loss_function: Callable[[], Callable[..., Any]] | None = None
    """Makes (on the rank) the loss verl's engine calls as `loss_function(model_output=, data=,
    dp_group=)`; None: the SFT trainer's own, `partial(sft_loss, config=None)`."""
    engine_mixin: type | None = None
    """A plain class of `FSDPEngineWithLMHead` overrides, mixed in before it on the rank (a case
    module then need not import verl); None: verl's engine as shipped."""
    sampler: Callable[[Sequence[MicroBatch], RankContext], Sequence[MicroBatch]] | None = None
    """What this rank's dataloader hands the trainer, from its DP replica's micro-batches; None:
    the replica's own, on every SP rank alike (verl's DistributedSampler over the DP rank and size)."""
    ignore_index: int = IGNORE_INDEX
    """The target value that carries no loss."""
    pad_token_id: int = PAD_ID
    """The pad token (fit's meta_info `pad_token_id`; unused on the remove-padding path)."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"VerlSFTSetup.model {self.model!r} is not one of {', '.join(MODELS)}")
        if self.max_pad < 0:
            raise ValueError(f"VerlSFTSetup.max_pad must be >= 0, got {self.max_pad}")


def verl_sft_shard(setup: VerlSFTSetup = VerlSFTSetup()) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory of a `verl_sft_case`: verl's engine over this rank's copy of the weights."""

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        from sp_harness.cases.frameworks.verl.step import VerlSFTStep

        step = VerlSFTStep(reference.get_submodule("lm"), ctx, setup)
        io = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)
        return Sharded(module=step.module, input_layout=io, output_layout=io, train_step=step)

    return shard


def _setup() -> None:
    """Per process: the shims (module doc), the platform before verl's engine module reads it, then
    the engine (no-ops where the fork server preloaded them, `PRELOAD`)."""
    from sp_harness.cases.frameworks.verl import shims

    shims.cpu_shims()
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401


def verl_sft_case(name: str, setup: VerlSFTSetup = VerlSFTSetup(), **case_fields: Any) -> Case:
    """A `Case` checking verl's own SFT training step (FSDP2 + Ulysses SP at world size / dp)
    against the same HF model in float64 on one device over the whole global batch, under the
    training-step check (`--train-step`). `case_fields`: any other `Case` field."""
    from sp_harness.cases.frameworks.hf.case import (
        HFTrainerSetup,
        build_lm,
        make_batch,
        shifted_loss_sum,
        shifted_tokens,
    )

    hf = HFTrainerSetup(model=setup.model, max_pad=setup.max_pad)
    case_fields.setdefault("setup", _setup)
    case_fields.setdefault("preload", PRELOAD)
    case_fields.setdefault("isolation", ISOLATION)

    def validate(cfg) -> None:
        releases.require("sp_harness.cases.frameworks.verl.compat", name)
        if not cfg.train_step:
            raise Unsupported("this case checks verl's own SFT training step: run the training-step check "
                              "(--train-step); the side-by-side check would run the engine's step instead")
        if cfg.dtype not in ("float32", "bfloat16"):
            raise Unsupported(f"verl's engine takes model_dtype fp32 or bf16 (its PrecisionType has no fp64), "
                              f"not {cfg.dtype}")
        sp = cfg.world_size // cfg.dp
        kv = cfg.num_kv_heads or cfg.num_heads
        if cfg.num_heads % sp or not (kv % sp == 0 or sp % kv == 0):
            raise Unsupported(f"verl's apply_monkey_patch needs num_attention_heads ({cfg.num_heads}) divisible by the "
                              f"Ulysses size {sp}, and num_key_value_heads ({kv}) dividing it or divisible by it")
        if cfg.seq_len < 3:
            raise ValueError(f"seq_len {cfg.seq_len}: the shifted loss needs at least 3 tokens (a prompt token and "
                             f"two that carry loss)")
        if cfg.hidden % cfg.num_heads or cfg.num_heads % kv:
            raise ValueError(f"num_heads({cfg.num_heads}) must divide hidden({cfg.hidden}) and num_kv_heads({kv}) "
                             f"num_heads")
        if cfg.layout not in (None, "bsh") or cfg.causal is False:
            raise Unsupported("an HF causal LM takes [b, s] token ids and is causal")

    defaults = {**GPT_DEFAULTS, "num_kv_heads": 4, "dtype": "float32", "prompt_len": 2,
                **case_fields.pop("defaults", {})}
    installed = releases.installed_release("verl") or "(not installed)"
    return Case(name=name, description=f"verl {installed} SFT training step ({setup.model}, FSDP2 + Ulysses SP "
                                       f"= world size / dp)",
                build_reference=lambda cfg: build_lm(hf, cfg, torch.float64), make_batch=make_batch(hf),
                shard=verl_sft_shard(setup), tokens=shifted_tokens, loss_sum=shifted_loss_sum,
                input_layout=Layout(seq_dim=1, batch_dim=0, seq_sharded=False), validate=validate, defaults=defaults,
                train_loss=TrainLoss(ignore_index=IGNORE_INDEX),
                tags=("verl", "framework", "train-step", *case_fields.pop("tags", ())), **case_fields)


__all__ = ["IGNORE_INDEX", "ISOLATION", "VerlSFTSetup", "verl_sft_case", "verl_sft_shard"]
