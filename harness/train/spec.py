"""Stage: train. What one training run is (`TrainSpec`), its LR schedule and its batch stream.

The stream comes from the case under test's `Training` declaration (sp_harness.config.case):
its `batches(config, step, data_seed)`, or by default the case's own `make_batch` with a
generator seeded from (data_seed, step). Every run of a convergence job (reference, baseline,
case) reads the stream of the case under test, so they all see the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sp_harness.config.case import Batch, Case, Training, as_batch
from sp_harness.config.check_config import CheckConfig


@dataclass(kw_only=True, frozen=True)
class TrainSpec:
    """One training run, as shipped to every rank."""

    run: str
    """Run name in the records: 'tp', 'sp', ..."""
    config: CheckConfig
    """Case, mesh, shapes, dtype, seed, lr, optimizer (seq_len/batch per DP replica)."""
    steps: int
    """Optimizer steps in total."""
    warmup_steps: int = 10
    """Linear LR warmup, then cosine decay to 10% of lr at the last step."""
    clip_grad_norm: float | None = None
    """Clip the global grad norm to this value; None: no clipping."""
    data_case: str = ""
    """The case whose `Training` supplies the batches; '': config.case. A baseline run names
    the case it is compared with, so both train on one stream."""
    data_seed: int = 1234
    """Seeds the batch stream, independently of the weights' seed."""
    reference_only: bool = False
    """Train the reference alone, nothing sharded: the reference curve of a job whose sharded
    run crashed (the reference copy trained inside that job is lost with it)."""


def lr_at(spec: TrainSpec, step: int) -> float:
    base = spec.config.lr
    assert base is not None, "base_config resolves lr"
    if step < spec.warmup_steps:
        return base * (step + 1) / spec.warmup_steps
    span = max(1, spec.steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def training_of(case: Case) -> Training:
    """The case's declared training, or the default: its own batches, no known floor."""
    return case.training if case.training is not None else Training()


def batch_at(case: Case, config: CheckConfig, step: int, data_seed: int) -> Batch:
    """Step `step`'s global batch of `case`'s training stream (CPU tensors)."""
    training = training_of(case)
    if training.batches is not None:
        return as_batch(training.batches(config, step, data_seed))
    gen = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
    return as_batch(case.make_batch(config, step, gen))


def loss_floor(case: Case, config: CheckConfig, data_seed: int) -> float | None:
    return training_of(case).loss_floor(config, data_seed)
