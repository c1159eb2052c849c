"""Stage: checks. Load balance of a context-parallel placement: does a case that says it balances
causal attention (`load_balancer='zigzag'`) give every rank about the same attention work?

A wrong placement is numerically correct (any permutation gives the same outputs), so no tensor
check can see it (pytorch/pytorch PR #189902). This check runs one forward of the case's sharded
model on real ranks (its rank job: sp_harness.checks.balance_rank) and reads the work each rank's
attention reports (sp_harness.capture.work: unmasked (query, key) pairs scored, with fully
masked blocks skipped), then compares the CP ranks of each DP replica. It applies to cases
tagged 'context-parallel'; a case whose attention reports no work is n/a, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from sp_harness.capture.work import RankWork
from sp_harness.checks.balance_rank import attention_work_rank
from sp_harness.checks.base import Outcome, not_applicable
from sp_harness.config import shards as sh
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.launch.runner import Runner

SLACK = 0.05
"""max / min causal work allowed where 2W divides seq_len over even shards (zigzag gives 1.0)."""


@dataclass(kw_only=True, frozen=True)
class Balance:
    ranks: tuple[RankWork, ...]
    """What each rank reported, by global rank."""

    @property
    def work(self) -> tuple[int, ...]:
        """Score elements per CP rank of the first DP replica (the replicas do the same work)."""
        return tuple(r.score_elements for r in self.ranks if r.dp_rank == 0)

    @property
    def ratio(self) -> float:
        return max(self.work) / min(self.work) if min(self.work) > 0 else float("inf")

    def describe(self) -> str:
        return (f"causal work per rank {list(self.work)} (unmasked score pairs, measured on the ranks): "
                f"max/min {self.ratio:.3g} (allowed {1 + SLACK:.3g})")


class LoadBalance:
    name = "load-balance"
    label = "load balance"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        config = case.resolve(config)
        if "context-parallel" not in case.tags:
            return f"{case.name} is not tagged 'context-parallel'"
        if config.load_balancer != "zigzag" or not config.causal:
            return "balance is claimed only for causal attention under load_balancer='zigzag'"
        assert config.seq_len is not None, "Case.resolve fills seq_len"
        shards = config.seq_shards or sh.chunk_sizes(config.seq_len, config.tp)
        if config.tp < 2 or not sh.is_even(shards) or config.seq_len % (2 * config.tp):
            return f"exact balance needs cp >= 2, even shards and 2W | seq_len (shards {list(shards)})"
        return None

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        case = get_case(config.case)
        config = case.resolve(config)
        label = f"load balance: case {config.case} [{config.short()}]"
        assert config.timeout_s is not None, "Case.resolve fills timeout_s"
        ranks = runner.run(config.world_size, attention_work_rank, config,
                           timeout_s=config.timeout_s, label=label, case=config.case)
        fig = Balance(ranks=tuple(ranks))
        if not any(r.num_meters for r in fig.ranks):
            return not_applicable(self.name, f"{config.case}'s attention reports no work (no module with a `work` list)")
        ok = fig.ratio <= 1 + SLACK
        if not ok and fig.ratio == float("inf"):
            return not_applicable(self.name, "a rank holds no tokens")
        return Outcome(check=self.name, status="pass" if ok else "fail", caught_by="" if ok else self.label,
                       detail=fig.describe(), repro=config.repro() + " --also load-balance", figures=fig)

    def render(self, outcome: Outcome) -> str:
        return f"load balance {outcome.status.upper()}: {outcome.detail}"


CHECK = LoadBalance()
