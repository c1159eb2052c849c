"""Stage: checks. Load balance of a context-parallel placement: does a case that says it balances
causal attention (`load_balancer='zigzag'`) place its tokens so every rank scores about the same
number of causal (query, key) pairs?

A wrong placement is numerically correct (any permutation gives the same outputs), so no tensor
check can see it (pytorch/pytorch PR #189902). This check reads the placement the case's sharded
factory declares (`Layout.seq_order`) and counts, per rank, the unmasked causal pairs of its
queries: a query at global position p attends p + 1 keys. It runs in the driver, no rank starts:
it applies to cases tagged 'context-parallel' whose factory only records its process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sp_harness.checks.base import Outcome, not_applicable
from sp_harness.config import shards as sh
from sp_harness.config.case import Case, RankContext, get_case
from sp_harness.config.check_config import CheckConfig

SLACK = 0.05
"""max / min causal work allowed where 2W divides seq_len over even shards (zigzag gives 1.0)."""


@dataclass(kw_only=True, frozen=True)
class Balance:
    work: tuple[int, ...]
    """Unmasked causal (query, key) pairs per CP rank, per sequence and head."""

    @property
    def ratio(self) -> float:
        return max(self.work) / min(self.work) if min(self.work) > 0 else float("inf")

    def describe(self) -> str:
        return f"causal work per rank {list(self.work)}: max/min {self.ratio:.3g} (allowed {1 + SLACK:.3g})"


def placement_work(case: Case, config: CheckConfig) -> Balance:
    """Per-rank causal work of the placement `case`'s sharded factory declares for `config`."""
    shards = config.seq_shards or sh.chunk_sizes(config.seq_len, config.tp)
    work = []
    for r in range(config.tp):
        ctx = RankContext(config=config, rank=r, world_size=config.tp, dp_rank=0, tp_rank=r, tp_group=None,
                          dp_group=None, tp_ranks=tuple(range(config.tp)), dp_ranks=(r,), seq_shards=shards,
                          device=torch.device("cpu"))
        layout = case.shard(case.build_reference(config), ctx).input_layout
        order = torch.arange(config.seq_len) if layout.seq_order is None else layout.seq_order(config.seq_len, shards)
        positions = order.narrow(0, sh.offsets(shards)[r], shards[r])
        work.append(int((positions + 1).sum()))
    return Balance(work=tuple(work))


class LoadBalance:
    name = "load-balance"
    label = "load balance"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        config = case.resolve(config)
        if "context-parallel" not in case.tags:
            return f"{case.name} is not tagged 'context-parallel'"
        if config.load_balancer != "zigzag" or not config.causal:
            return "balance is claimed only for causal attention under load_balancer='zigzag'"
        shards = config.seq_shards or sh.chunk_sizes(config.seq_len, config.tp)
        if config.tp < 2 or not sh.is_even(shards) or config.seq_len % (2 * config.tp):
            return f"exact balance needs cp >= 2, even shards and 2W | seq_len (shards {list(shards)})"
        return None

    def run(self, config: CheckConfig, runner) -> Outcome:
        case = get_case(config.case)
        config = case.resolve(config)
        fig = placement_work(case, config)
        ok = fig.ratio <= 1 + SLACK
        if not ok and fig.ratio == float("inf"):
            return not_applicable(self.name, "a rank holds no tokens")
        return Outcome(check=self.name, status="pass" if ok else "fail", caught_by="" if ok else self.label,
                       detail=fig.describe(), repro=config.repro() + " --also load-balance", figures=fig)

    def render(self, outcome: Outcome) -> str:
        return f"load balance {outcome.status.upper()}: {outcome.detail}"


CHECK = LoadBalance()
