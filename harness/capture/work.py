"""Stage: capture. The attention work each context-parallel rank really does in a forward.

A module that scores attention block by block may keep a `work: list[int]` attribute, to which
each forward appends the unmasked (query, key) score elements of every block it computed (per
sequence and head; cases/ring/attention.py's RingAttention does). A load balancer is judged on
these counts, taken on the ranks in a real forward of the case's sharded model, not on where the
case says it put its tokens: a case whose masks, block skipping or placement disagree with its
declaration is measured as it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sp_harness.config.check_config import CheckConfig


@dataclass(kw_only=True, frozen=True)
class RankWork:
    """What one rank's attention scored in one forward."""

    rank: int
    cp_rank: int
    """Its rank in the context-parallel (SP) group."""
    dp_rank: int
    num_meters: int
    """Modules that reported work (attention layers); 0: the case exposes none."""
    num_blocks: int
    """Blocks scored, over all layers (a fully masked block is skipped and not counted)."""
    score_elements: int
    """Unmasked (query, key) pairs scored, over all layers, per sequence and head."""


def work_meters(model: torch.nn.Module) -> list[list[int]]:
    """The `work` lists of the modules that keep one (see the module docstring)."""
    found = [getattr(m, "work", None) for m in model.modules()]
    return [work for work in found if isinstance(work, list)]


def attention_work_rank(config: CheckConfig) -> RankWork:
    """Rank job: build the case's sharded model as the engine does, run one forward on this rank's
    piece of a batch, and return the work its attention modules reported."""
    from sp_harness.config.case import as_batch
    from sp_harness.step.build import build
    from sp_harness.step.inputs import batch_generator, call, rank_batch

    built = build(config)
    model = built.sharded.module
    meters = work_meters(model)
    for work in meters:
        work.clear()
    batch = as_batch(built.case.make_batch(config, 0, batch_generator(config.seed)))
    local = rank_batch(batch, built.sharded, built.ctx, config.torch_dtype)
    with torch.no_grad():
        call(model, local.call_inputs, local.positional)
    counts = [w for work in meters for w in work]
    return RankWork(rank=built.ctx.rank, cp_rank=built.ctx.tp_rank, dp_rank=built.ctx.dp_rank, num_meters=len(meters),
                    num_blocks=len(counts), score_elements=sum(counts))
