"""Stage: step. The global batch of one training step, cut into K micro-batches whose valid-token
masks make the training step's bugs visible.

Loss-normalisation and accumulation bugs vanish when every rank and every micro-batch holds the
same number of valid tokens: a mean of micro-batch means equals the token mean, a rank's own
count equals the global count over the ranks. So the masks are drawn so that counts differ:
each micro-batch keeps tokens with its own probability (`VALID_FRACTIONS`), the last of K >= 2
holds no valid token at all, and one rank (the last DP replica's last sequence shard, where the
ranks split the tokens) holds none in any micro-batch. The middle micro-batches keep tokens, so
one dropped from the accumulation changes the grads.
"""

from __future__ import annotations

import dataclasses

import torch

from sp_harness.config.case import Batch, Case, Layout, as_batch
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.step_protocol import MicroBatch
from sp_harness.step.inputs import RankBatch, cut

VALID_FRACTIONS = (0.85, 0.55, 0.3)
"""Probability that a token keeps its loss, by micro-batch (cycling): three different counts,
so no two adjacent micro-batches are alike in expectation."""


def _holder_region(shape: tuple[int, ...], layout: Layout, ctx: RankContext) -> torch.Tensor | None:
    """bool (shape): the tokens of the last DP replica's last sequence shard, where the ranks hold
    different tokens (a sequence-sharded target, or dp > 1); None where every rank holds them all."""
    split_seq = layout.seq_dim is not None and layout.seq_sharded and ctx.tp > 1
    split_dp = layout.batch_dim is not None and ctx.dp > 1
    if not (split_seq or split_dp):
        return None
    last = dataclasses.replace(ctx, dp_rank=ctx.dp - 1, tp_rank=ctx.tp - 1)
    index = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    region = torch.zeros(index.numel(), dtype=torch.bool)
    region[cut(index, layout, last)[0].reshape(-1)] = True
    return region.view(shape)


def micro_batches(case: Case, config: CheckConfig, step: int, gen: torch.Generator, *, layout: Layout,
                  ctx: RankContext) -> list[Batch]:
    """Step `step`'s K global micro-batches (the case's `make_batch`, K in a row from `gen`), with
    the drawn masks written into their targets as the case's ignore index. `layout`: the target's
    (how the ranks split the loss's tokens). Every rank draws the same ones."""
    assert case.train_loss is not None, "the training-step check runs cases that declare train_loss"
    ignore = case.train_loss.ignore_index
    num = config.micro_batches
    made = []
    for k in range(num):
        batch = as_batch(case.make_batch(config, step * num + k, gen))
        target = batch.target.clone()
        owed = target != ignore  # the case's own ignored targets (a prompt) stay ignored
        keep = owed & (torch.rand(target.shape, generator=gen) < VALID_FRACTIONS[k % len(VALID_FRACTIONS)])
        region = _holder_region(tuple(target.shape), layout, ctx)
        allowed = owed if region is None else owed & ~region
        if num >= 2 and k == num - 1:
            keep[...] = False
        else:
            keep &= allowed
            if not keep.any() and allowed.any():
                # a draw that left a micro-batch empty would make an accumulation bug a division
                # by zero; the one empty micro-batch is the last, by design
                keep.view(-1)[int(allowed.view(-1).nonzero()[0])] = True
        target[~keep] = ignore
        made.append(dataclasses.replace(batch, target=target))
    if all(bool((b.target == ignore).all()) for b in made):
        raise ValueError(f"case {case.name} [{config.short()}]: the global batch of step {step} has no valid "
                         f"token outside the one rank left without any; the training-step check needs targets "
                         f"that carry loss (raise seq_len or batch, or lower prompt_len)")
    return made


def concatenated(batches: list[Batch], batch_dim: int) -> Batch:
    """The micro-batches as one global batch along `batch_dim` (what the reference runs at once)."""
    first = batches[0]
    inputs = {name: torch.cat([b.inputs[name] for b in batches], dim=batch_dim)
              if isinstance(value, torch.Tensor) else value for name, value in first.inputs.items()}
    return dataclasses.replace(first, inputs=inputs, target=torch.cat([b.target for b in batches], dim=batch_dim))


def micro_batch_count(rows_per_replica: int, wanted: int) -> int:
    """The most micro-batches, at most `wanted`, that split a replica's rows evenly (a training
    run's batch of 8 rows per replica and K = 3 asked: 2)."""
    return max(k for k in range(1, max(1, wanted) + 1) if rows_per_replica % k == 0)


def split_rows(batch: Batch, num: int, dp: int, batch_dim: int) -> list[Batch]:
    """One global batch as `num` micro-batches that keep each DP replica's rows on that replica:
    micro-batch k holds the k-th of `num` equal slices of every replica's rows, so the engine's
    DP cut of it gives each replica a slice of its own rows."""
    rows = batch.target.shape[batch_dim]
    assert rows % (dp * num) == 0, f"{rows} rows do not split into {dp} replicas x {num} micro-batches"
    per = rows // (dp * num)

    def take(t, k: int):
        if not isinstance(t, torch.Tensor):
            return t
        index = torch.cat([torch.arange(d * num * per + k * per, d * num * per + (k + 1) * per) for d in range(dp)])
        return t.index_select(batch_dim, index.to(t.device))

    return [dataclasses.replace(batch, inputs={n: take(v, k) for n, v in batch.inputs.items()},
                                target=take(batch.target, k)) for k in range(num)]


def micro_batch(local: RankBatch, ignore_index: int) -> MicroBatch:
    """This rank's piece of one micro-batch (`ShardedLoop.local_batch`) as a training step takes it."""
    return MicroBatch(inputs=local.call_inputs, target=local.target, valid=local.target != ignore_index,
                      positional=local.positional)
