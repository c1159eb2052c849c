"""Stage: config. What one verification run is: the case, the mesh, the shapes, the numerics.

`CheckConfig` is frozen and hashable; a case fills the fields left as `None` from its own
defaults (`Case.resolve`). `repro()` turns a config back into the one-line command that reruns it.
Each field is declared once, here or in its knob class (sp_harness.config.gpt_knobs): the flags,
their help and the value checks are generated from the declarations (sp_harness.config.flags).
"""

from __future__ import annotations

import dataclasses
import shlex
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from sp_harness.config.flags import check_values, knob, repro_args
from sp_harness.config.gpt_knobs import LAYOUTS, LOAD_BALANCERS, NORMS, GPTKnobs  # noqa: F401 (re-exported)

# moved to a torch-free module the pytest plugin can import at configure: kept importable here
from sp_harness.config.timeouts import DEFAULT_TIMEOUT_S, default_timeout_s, set_session_timeout  # noqa: F401

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DType = Literal["float64", "float32", "bfloat16"]
Optimizer = Literal["adamw", "sgd"]
Adversary = Literal["off", "reorder", "reorder-tf32"]
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in typing.get_args(DType)}
OPTIMIZERS: tuple[str, ...] = typing.get_args(Optimizer)
ADVERSARIES: tuple[str, ...] = typing.get_args(Adversary)
K = TypeVar("K", bound="DataclassInstance")
DEFAULT_STEPS = 3
"""Optimizer steps per check: the third step is the first with two steps of optimizer state
behind it and the first after a DDP-style grad-bucket rebuild (tests/test_conventions.py)."""

ENGINE_DEFAULTS: dict[str, object] = dict(batch=2, norm="layernorm", layout="bsh", dtype="float64",
                                         steps=DEFAULT_STEPS, lr=1e-2, optimizer="adamw", causal=True,
                                         load_balancer="none", ring_degree=1, prompt_len=0, forward_only=False)
"""What a field left as None becomes when the case sets no default of its own (`Case.resolve`);
the job timeout is `default_timeout_s()`."""
@dataclass(kw_only=True, frozen=True)
class RunFields:
    """The fields a check (`CheckConfig`) and a convergence run (`ConvergeOptions`) share, declared
    once: each one's flag, help and valid values are generated from here (sp_harness.config.flags);
    a run type changes a default by redeclaring the field with its new default (and a docstring
    where the meaning differs). A field left None is filled from the case (`Case.resolve`), then
    from `ENGINE_DEFAULTS`."""

    case: str
    """Case name (see `sp-harness list`) or path/to/file.py:NAME for a user's own case."""
    world_size: int = knob(2, min=1)
    """Ranks in the job; the mesh is dp x tp with tp = world-size / dp."""
    dp: int = knob(1, min=1)
    """Data-parallel degree; each DP replica gets its own micro-batch."""
    seq_len: int | None = knob(min=1)
    """Global sequence length (tokens per sequence). None: the case's default."""
    batch: int | None = knob(min=1)
    """Sequences per DP replica; the reference sees dp * batch. None: the case's default."""
    dtype: DType | None = None
    """Dtype of the sharded run and of the same-dtype reference; the judge is always float64.
    None: the case's default."""
    steps: int | None = knob(min=1)
    """Optimizer steps to run and compare. None: the case's default."""
    seed: int = 0
    """Seeds the initial weights and the data."""
    lr: float | None = knob(positive=True)
    """Learning rate of the optimizer. None: the case's default."""
    optimizer: Optimizer | None = None
    """The optimizer. None: the case's default."""
    timeout_s: float | None = knob(name="--timeout", positive=True)
    """Seconds a job may run at most, a hard cap; the error names case, config and rank. Below it a
    job whose ranks make no progress for 10 s (asleep, or blocked in a collective their peers
    never enter), or that runs past 10 x its steps at its first step's pace (at least 120 s),
    ends sooner, saying which. None: $SP_HARNESS_TIMEOUT, else 3600."""

    def run_values(self) -> dict[str, typing.Any]:
        """This object's values of the shared fields: what a convergence run hands its check
        config (`CheckConfig(**opts.run_values(), ...)`), so a new shared field needs no other edit."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RunFields)}

    def __post_init__(self) -> None:
        check_values(self)
        if self.world_size % self.dp:
            raise ValueError(f"dp({self.dp}) does not divide world_size({self.world_size})")


@dataclass(kw_only=True, frozen=True)
class CheckConfig(GPTKnobs, RunFields):
    """What one check runs: the shared run fields (`RunFields`), the knobs of the GPT-style cases
    (`GPTKnobs`, sp_harness.config.gpt_knobs) and the check's own fields below; flat, so records
    and `config.hidden` read every field alike. The generated flags name `ENGINE_DEFAULTS` as
    what an unset field becomes when the case sets no default."""

    seq_shards: tuple[int, ...] | None = knob(min=0)
    """Explicit tokens per TP rank, e.g. 4,4,2 (sums to seq_len). None: torch.chunk's split."""
    adversary: Adversary = "off"
    """'reorder': the sharded side reduces in random legal orders (sp_harness.step.adversary),
    specificity across platforms; 'reorder-tf32': also TF32-rounded float32 matmul inputs on
    both sides (a GPU platform)."""
    forward_only: bool | None = None
    """Inference: the sharded side runs forward only (under no_grad), no backward, no grad sync, no
    optimizer step; the references run forward only. Judged: the output, the loss, attention
    LSEs; input grads, grads and updates are not (the result says so). None: the case's default."""
    train_step: bool = False
    """Run the case's own training step (`Sharded.train_step`: its loss normalisation, gradient
    accumulation, grad sync, clipping and optimizer) and judge it against the loss the case
    declares (`Case.train_loss`): the training-step check instead of the side-by-side one."""
    micro_batches: int = knob(3, min=1)
    """Micro-batches per optimizer step of the training-step check; every one holds dp * batch
    sequences, their valid tokens drawn unevenly across ranks and micro-batches."""
    clip_grad_norm: float | None = knob(positive=True)
    """The global grad norm the training step clips to. None: no clipping."""

    def __post_init__(self) -> None:
        RunFields.__post_init__(self)
        if self.prompt_len and self.seq_len is not None and self.prompt_len >= self.seq_len:
            raise ValueError(f"prompt_len({self.prompt_len}) must be < seq_len({self.seq_len}): a sequence "
                             f"needs at least one target")
        if self.train_step and self.forward_only:
            raise ValueError("train_step and forward_only exclude each other: a training step runs backward")
        if self.seq_shards is not None:
            if len(self.seq_shards) != self.tp:
                raise ValueError(
                    f"seq_shards has {len(self.seq_shards)} entries {list(self.seq_shards)}, "
                    f"need one per TP rank (tp={self.tp})"
                )
            if self.seq_len is not None and sum(self.seq_shards) != self.seq_len:
                raise ValueError(
                    f"seq_shards {list(self.seq_shards)} sum to {sum(self.seq_shards)}, "
                    f"not seq_len({self.seq_len})"
                )

    @property
    def tp(self) -> int:
        return self.world_size // self.dp

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype is not None, "torch_dtype of an unresolved config (Case.resolve fills dtype)"
        return DTYPES[self.dtype]

    def knob_values(self, knobs: type[K]) -> K:
        """This config's values of one knob class's fields, as that class (`Case.knobs`)."""
        return knobs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(knobs)})

    def replace(self, **changes) -> "CheckConfig":
        return dataclasses.replace(self, **changes)

    def repro(self) -> str:
        """The one-line command that reruns exactly this config: the case and the mesh always
        (the rerun's defaults are built with them), then what differs from the rerun's defaults."""
        keep = {"case", "world_size"} | ({"dp"} if self.dp != 1 else set())
        keep |= {"seq_shards"} if self.seq_shards is not None else set()
        return shlex.join(["sp-harness", "check", *repro_args(self, _resolved_default(self), keep=keep)])

    def short(self) -> str:
        """Compact one-line description for tables and error messages."""
        parts = [f"ws={self.world_size}"]
        if self.dp > 1:
            parts.append(f"dp={self.dp}")
        for name in ("seq_len", "hidden", "ffn", "num_heads"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value}")
        if self.seq_shards is not None:
            parts.append("shards=" + "/".join(map(str, self.seq_shards)))
        for name, default in (("layout", "bsh"), ("norm", "layernorm"), ("optimizer", "adamw"), ("adversary", "off")):
            if getattr(self, name) not in (default, None):
                parts.append(getattr(self, name))
        if self.forward_only:
            parts.append("forward-only")
        if self.train_step:
            parts.append(f"train-step K={self.micro_batches}")
            if self.clip_grad_norm is not None:
                parts.append(f"clip={self.clip_grad_norm:g}")
        parts += [f"{name}={getattr(self, name)}" for name in self._other_knobs_set()]
        parts += [str(self.dtype), f"steps={self.steps}", f"seed={self.seed}"]
        return " ".join(parts)

    def _other_knobs_set(self) -> list[str]:
        """The fields `short` has no place for whose value is not the case's default (a header
        must name every knob a run changed: lr, batch, causal, ...)."""
        try:
            defaults = CASE_DEFAULTS[0](self.case) if CASE_DEFAULTS else ENGINE_DEFAULTS
        except ValueError:  # a case file that no longer loads: name every field set
            defaults = {}
        return [name for name in SHORT_OTHERS
                if getattr(self, name) is not None and getattr(self, name) != defaults.get(name)]


KNOBS: tuple[type, ...] = tuple(b for b in CheckConfig.__bases__ if b is not RunFields)
"""The knob classes `CheckConfig` carries (its bases besides `RunFields`): a case names the one
it reads (`Case.knobs`)."""

SHORT_OTHERS = ("batch", "lr", "num_kv_heads", "causal", "load_balancer", "ring_degree", "prompt_len", "num_layers",
                "vocab")
"""The knobs `CheckConfig.short` names only where they differ from the case's default."""
CASE_DEFAULTS: list = []
"""The registry's defaults lookup (case name -> the values a None field resolves to), put here by
sp_harness.config.registry as `RESOLVE` is."""
RESOLVE: list = []
"""The registry's resolver (config -> its case's `resolve(config)`), put here by sp_harness.config.registry
when it loads: the registry imports this module, so this module does not import it back."""


def _resolved_default(config: CheckConfig) -> CheckConfig:
    """The config a rerun with no flags but case, world size and dp resolves to."""
    bare = CheckConfig(case=config.case, world_size=config.world_size, dp=config.dp, seq_shards=config.seq_shards)
    try:
        return RESOLVE[0](bare)
    except ValueError:  # a case file that no longer loads: name every field
        return CheckConfig(case=config.case)
