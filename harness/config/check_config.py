"""Stage: config. What one verification run is: the case, the mesh, the shapes, the numerics.

`CheckConfig` is frozen and hashable; a case fills the fields left as `None` from its own
defaults (`Case.resolve`). `repro()` turns a config back into the one-line command that reruns it.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
NORMS = ("layernorm", "rmsnorm")
LAYOUTS = ("bsh", "sbh")
OPTIMIZERS = ("adamw", "sgd")
ADVERSARIES = ("off", "reorder", "reorder-tf32")
DEFAULT_STEPS = 3
"""Optimizer steps per check: the third step is the first with two steps of optimizer state
behind it and the first after a DDP-style grad-bucket rebuild (tests/test_conventions.py)."""


LOAD_BALANCERS = ("none", "zigzag")
ENGINE_DEFAULTS: dict[str, object] = dict(batch=2, norm="layernorm", layout="bsh", dtype="float64",
                                         steps=DEFAULT_STEPS, lr=1e-2, optimizer="adamw", causal=True,
                                         load_balancer="none", ring_degree=1, prompt_len=0, forward_only=False)
"""What a field left as None becomes when the case sets no default of its own (`Case.resolve`);
the job timeout is `default_timeout_s()`."""
DEFAULT_TIMEOUT_S = 30.0
_session_timeout_s: float | None = None


def set_session_timeout(seconds: float | None) -> None:
    """This process's job timeout, above the environment's (the pytest plugin sets its resolved
    `sp_timeout` here, so every check a test runs gets it, and no environment variable leaks into
    code that never asked for sp-harness); None clears it."""
    global _session_timeout_s
    _session_timeout_s = seconds


def default_timeout_s() -> float:
    """Seconds a job may run: the session's (`set_session_timeout`), else SP_HARNESS_TIMEOUT
    where set, else DEFAULT_TIMEOUT_S."""
    import os

    if _session_timeout_s is not None:
        return _session_timeout_s
    text = os.environ.get("SP_HARNESS_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"SP_HARNESS_TIMEOUT must be a finite number of seconds > 0, got {text!r}")
    return value


@dataclass(kw_only=True, frozen=True)
class CheckConfig:
    case: str
    """Case name from the registry, or `path/to/file.py:NAME` for a user's own case."""
    world_size: int = 2
    """Ranks in the job; the mesh is dp x tp with tp = world_size // dp."""
    dp: int = 1
    """Data-parallel degree; each DP replica gets its own micro-batch."""
    seq_len: int | None = None
    """Global sequence length (tokens per sequence); None means the case's default."""
    seq_shards: tuple[int, ...] | None = None
    """Explicit tokens per TP rank (sums to seq_len); None means torch.chunk's split."""
    batch: int | None = None
    """Sequences per DP replica; the reference sees dp * batch. None: the case's default, else 2."""
    hidden: int | None = None
    """Model width; None means the case's default."""
    ffn: int | None = None
    """MLP inner width; None means the case's default."""
    num_heads: int | None = None
    """Attention heads; None means the case's default."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention: fewer than num_heads, dividing it); None: the
    case's default, else num_heads."""
    causal: bool | None = None
    """Causal attention (True) or full bidirectional attention; None: the case's default, else True."""
    load_balancer: str | None = None
    """How a context-parallel case places sequence chunks: 'none' (contiguous shards) or 'zigzag'
    (2W chunks, rank i holds chunks i and 2W-1-i); None: the case's default, else 'none'."""
    ring_degree: int | None = None
    """For a hybrid Ulysses x ring case: ranks in each ring (the Ulysses degree is tp / ring_degree);
    None: the case's default, else 1."""
    prompt_len: int | None = None
    """Leading tokens of every sequence whose targets carry no loss (label -100, the prompt of a
    fine-tuning sample): a rank holding only prompt tokens has no target tokens, and the loss is
    normalised by the targets that count. Must be < seq_len. None: the case's default, else 0."""
    num_layers: int | None = None
    """Transformer blocks; None means the case's default."""
    vocab: int | None = None
    """Vocabulary size; None means the case's default."""
    norm: str | None = None
    """'layernorm' or 'rmsnorm' for cases that have norms. None: the case's default, else layernorm."""
    layout: str | None = None
    """Activation layout for cases that support both: 'bsh' (GPT-NeoX) or 'sbh' (Megatron). None:
    the case's default, else bsh."""
    dtype: str | None = None
    """Dtype of the sharded run and of the same-dtype reference; the judge is always float64.
    None: the case's default, else float64."""
    steps: int | None = None
    """Optimizer steps to run and compare. None: the case's default, else DEFAULT_STEPS."""
    seed: int = 0
    """Seeds the initial weights and the data."""
    lr: float | None = None
    """Learning rate of the optimizer. None: the case's default, else 1e-2."""
    optimizer: str | None = None
    """'adamw' or 'sgd'. None: the case's default, else adamw."""
    adversary: str = "off"
    """'reorder': the sharded side reduces in random legal orders (sp_harness.step.adversary);
    'reorder-tf32': also TF32-rounded float32 matmul inputs on both sides (a GPU platform)."""
    timeout_s: float | None = None
    """Seconds before a job is declared hung; the error names case, config and rank."""
    forward_only: bool | None = None
    """Inference: the sharded side runs forward only (under no_grad), no backward, no grad sync, no
    optimizer step; the references run forward only. Judged: the output, the loss, attention
    LSEs; input grads, grads and updates are not (the result says so). None: the case's default,
    else False."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.dp < 1 or self.world_size % self.dp:
            raise ValueError(f"dp({self.dp}) does not divide world_size({self.world_size})")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.norm is not None and self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.adversary not in ADVERSARIES:
            raise ValueError(f"adversary must be one of {ADVERSARIES}, got {self.adversary!r}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.timeout_s is not None and (not math.isfinite(self.timeout_s) or self.timeout_s <= 0):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.lr is not None and (not math.isfinite(self.lr) or self.lr <= 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if self.load_balancer is not None and self.load_balancer not in LOAD_BALANCERS:
            raise ValueError(f"load_balancer must be one of {LOAD_BALANCERS}, got {self.load_balancer!r}")
        for field in ("seq_len", "hidden", "ffn", "num_heads", "num_kv_heads", "num_layers", "vocab", "ring_degree"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if self.prompt_len is not None and self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.prompt_len and self.seq_len is not None and self.prompt_len >= self.seq_len:
            raise ValueError(f"prompt_len({self.prompt_len}) must be < seq_len({self.seq_len}): a sequence "
                             f"needs at least one target")
        if self.seq_shards is not None:
            if len(self.seq_shards) != self.tp:
                raise ValueError(
                    f"seq_shards has {len(self.seq_shards)} entries {list(self.seq_shards)}, "
                    f"need one per TP rank (tp={self.tp})"
                )
            if any(n < 0 for n in self.seq_shards):
                raise ValueError(f"seq_shards must be >= 0, got {list(self.seq_shards)}")
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

    def replace(self, **changes) -> "CheckConfig":
        return dataclasses.replace(self, **changes)

    def repro(self) -> str:
        """The one-line command that reruns exactly this config."""
        args = ["sp-harness", "check", "--case", self.case, "--world-size", str(self.world_size)]
        if self.dp != 1:  # the mesh: never a default to leave out (the rerun's default is built with it)
            args += ["--dp", str(self.dp)]
        default = _resolved_default(self)
        for field in dataclasses.fields(self):
            if field.name in ("case", "world_size", "dp"):
                continue
            value = getattr(self, field.name)
            if value is None or (value == getattr(default, field.name) and field.name != "seq_shards"):
                continue  # what the rerun fills in anyway: the same case's default at this mesh
            if isinstance(value, tuple):
                value = ",".join(map(str, value))
            if isinstance(value, bool):
                value = "yes" if value else "no"
            flag = "--timeout" if field.name == "timeout_s" else "--" + field.name.replace("_", "-")
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
        return shlex.join(args)

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
        parts += [str(self.dtype), f"steps={self.steps}", f"seed={self.seed}"]
        return " ".join(parts)


RESOLVE: list = []
"""The registry's resolver (config -> its case's `resolve(config)`), put here by sp_harness.config.case
when it loads: the registry imports this module, so this module does not import it back."""


def _resolved_default(config: CheckConfig) -> CheckConfig:
    """The config a rerun with no flags but case, world size and dp resolves to."""
    bare = CheckConfig(case=config.case, world_size=config.world_size, dp=config.dp, seq_shards=config.seq_shards)
    try:
        return RESOLVE[0](bare)
    except ValueError:  # a case file that no longer loads: name every field
        return CheckConfig(case=config.case)
