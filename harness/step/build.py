"""Stage: step. Rank side: the one place a job builds its models: check,
training, the benchmark and the memory measurement all start here.

Every model comes from the case's factory, never from a deep copy (a framework's module may hold
process groups, which cannot be copied), and is cast to its dtype by `cast_floating`: floating
tensors only, so a complex RoPE cache or an integer buffer keeps its dtype and values.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from sp_harness.config.case import Case, Sharded
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import get_case
from sp_harness.launch import announce
from sp_harness.step.context import make_context, rank_device, reference_context
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
    """The case's sharded model, made from the factory's model loaded with the reference's state
    and cast to the run dtype."""
    params: list[LocalParam]
    """Every local parameter with where it lives in the reference."""


def cast_floating(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` with its floating params and buffers in `dtype`; complex and integer tensors keep
    their dtype and values (`Module.to(dtype)` casts complex ones too, dropping the imaginary
    part of a complex64 RoPE cache with only a warning)."""
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def new_reference(case: Case, config: CheckConfig, ctx: RankContext | None) -> nn.Module:
    """A fresh model from the case's factory: `build_reference(config)` or, for a factory that
    takes two arguments, `build_reference(config, ctx)` with the reference's own rank context."""
    factory = case.build_reference
    if _takes_context(factory):
        # the two-argument form (its second positional parameter); ctx is None only for a caller
        # outside any rank, which the factory's own contract (RankContext) does not cover
        return cast("Callable[[CheckConfig, RankContext | None], nn.Module]", factory)(config, ctx)
    return cast("Callable[[CheckConfig], nn.Module]", factory)(config)


def _takes_context(factory) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def reference_copy(case: Case, config: CheckConfig, ctx: RankContext | None, like: nn.Module,
                   dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Another model from the factory holding exactly `like`'s state, in `dtype` on `device`."""
    model = new_reference(case, config, ctx).to(device=device)
    model.load_state_dict(like.state_dict())
    return cast_floating(model, dtype)


def build(config: CheckConfig, *, reference_dtype: torch.dtype = torch.float64,
          around_shard: contextlib.AbstractContextManager | None = None) -> Built:
    """`around_shard`: a context the case's sharded factory runs in (the check's collective
    accounting: collectives issued while sharding are the system under test's too)."""
    # the phases say where a failure came before the code under test stepped (verdict ERROR)
    announce.phase("loading the case")
    case = get_case(config.case)
    config = case.resolve(config)  # idempotent: a job handed an unresolved config runs what a check would
    device = rank_device()
    ctx = make_context(config, device)
    ref_ctx = reference_context(config, device)
    announce.phase("building the reference")
    reference = cast_floating(new_reference(case, config, ref_ctx).to(device=device), reference_dtype)
    # the sharded factory starts from the reference's weights, cast to the run dtype (a model
    # made outside `around_shard`: building it is the reference's business, not the sharded code's)
    copy = reference_copy(case, config, ref_ctx, reference, config.torch_dtype, device)
    announce.phase("shard()")
    with around_shard or contextlib.nullcontext():
        sharded = case.shard(copy, ctx)
    announce.phase("mapping the params")
    params = map_params(sharded, {n: p.shape for n, p in reference.named_parameters()}, case.name, ctx)
    return Built(case=case, config=config, ctx=ctx, device=device, reference=reference, sharded=sharded, params=params)
