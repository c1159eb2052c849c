"""Stage: config. What one lockstep convergence run is (`sp-harness converge`, `golden`, the
lockstep check): the fields it shares with a check (`RunFields`, with converge's own defaults)
and its own; the command line and the repro line are generated from them (sp_harness.config.flags).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from sp_harness.config.check_config import DType, Optimizer, RunFields
from sp_harness.config.flags import knob, repro_args, to_arg


@dataclass(kw_only=True, frozen=True)
class ConvergeOptions(RunFields):
    # converge's defaults for the shared fields; their flags and meaning are RunFields'
    case: str = "megatron-gpt-sp"
    steps: int = 200
    dtype: DType = "float32"
    """Training dtype of every run; the gate's bands follow it."""
    optimizer: Optimizer = "adamw"
    lr: float = 1e-2
    """Peak learning rate (linear warmup, then cosine decay)."""
    timeout_s: float = 120.0
    """Seconds per job (setup, or one chunk of steps) before it counts as hung."""
    seq_len: int | None = None
    """Tokens per sequence. None: the case's convergence default (`Training.seq_len`: 32 for the
    GPT cases), else its check default."""
    batch: int | None = None
    """Sequences per DP replica and step. None: the case's convergence default (`Training.batch`:
    8 for the GPT cases), else its check default."""
    # converge's own
    baseline: str | None = None
    """The baseline case trained beside it; 'none' (or '') skips it. None: the case's declared
    baseline (`Case.baseline`)."""
    warmup_steps: int = 10
    """Linear warmup steps, then cosine decay."""
    clip_grad_norm: float | None = knob(1.0, none="0")
    """Global grad-norm clipping. None: off."""
    data_seed: int = 1234
    """The batch stream (and, for the GPT cases, the Markov chain)."""

    def baseline_case(self) -> str:
        from sp_harness.config.registry import get_case

        return get_case(self.case).baseline if self.baseline is None else self.baseline


def repro_line(command: str, opts: Any, *positional: str, **extra: Any) -> str:
    """The `sp-harness` command line that repeats a run: every field of the options dataclass
    `opts` that differs from its default (floats by repr, so they parse back bit for bit), then
    the `extra` flags that are not None. The report directory is not part of it."""
    args = ["sp-harness", command, *positional, *repro_args(opts, type(opts)())]
    for name, value in extra.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), to_arg(value)]
    return shlex.join(args)
