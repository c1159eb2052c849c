"""Stage: checks. The load-balance check's rank job (sp_harness.checks.balance drives it).

`attention_work_rank(config)` is the job the pool runs: the case's sharded model built as the
engine builds it, one forward on this rank's piece of a batch, and the work its attention modules
reported (sp_harness.capture.work).
"""

from __future__ import annotations

import torch

from sp_harness.capture.work import RankWork, work_meters
from sp_harness.config.check_config import CheckConfig


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
