"""Stage: build reference + sharded (rank side). The one place a job builds its models: check,
training, the benchmark and the memory measurement all start here."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn

from sp_harness.config.case import Case, RankContext, Sharded, get_case
from sp_harness.config.check_config import CheckConfig
from sp_harness.step.context import make_context, rank_device
from sp_harness.step.params import LocalParam, map_params


@dataclass(kw_only=True)
class Built:
    """One rank's models for one job."""

    case: Case
    config: CheckConfig
    """The job's config, resolved (every default filled in)."""
    ctx: RankContext
    device: torch.device
    reference: nn.Module
    """The single-device reference, whole, in `reference_dtype`."""
    sharded: Sharded
    """The case's sharded model, made from a copy of the reference in the run dtype."""
    params: list[LocalParam]
    """Every local parameter with where it lives in the reference."""


def build(config: CheckConfig, *, reference_dtype: torch.dtype = torch.float64,
          around_shard: contextlib.AbstractContextManager | None = None) -> Built:
    """`around_shard`: a context the case's sharded factory runs in (the check's collective
    accounting: collectives issued while sharding are the system under test's too)."""
    case = get_case(config.case)
    config = case.resolve(config)  # idempotent: a job handed an unresolved config runs what a check would
    device = rank_device()
    ctx = make_context(config, device)
    reference = case.build_reference(config).to(device=device, dtype=reference_dtype)
    # the sharded factory starts from the reference's weights, cast to the run dtype
    with around_shard or contextlib.nullcontext():
        sharded = case.shard(copy.deepcopy(reference).to(config.torch_dtype), ctx)
    params = map_params(sharded, {n for n, _ in reference.named_parameters()}, case.name)
    return Built(case=case, config=config, ctx=ctx, device=device, reference=reference, sharded=sharded, params=params)
