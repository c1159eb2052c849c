"""Stage: checks. Degree invariance: the case's own step on its mesh against the same step on one
rank, over the same global batch (the same sequences, the same tokens without loss) and from the
same params. A step that normalises by a rank's own token count, scales by a parallel degree or
skips a group's grad sync fails here, without a reference model to trust."""

from __future__ import annotations

import time

from sp_harness.checks.base import Outcome
from sp_harness.checks.invariance import applies, compare, get_case, outcome, prepared, render, run_variant
from sp_harness.checks.invariance_rank import InvariancePayload
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.launch.failure import RankFailure
from sp_harness.launch.runner import Runner

NAME = "degree-invariance"


class DegreeInvariance:
    name = NAME
    label = "degree invariance"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        why = applies(case)
        if why is None and config.world_size < 2:
            return "world_size 1: no parallel degree to compare with 1"
        return why

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        t0 = time.perf_counter()
        case = get_case(config.case)
        ready = prepared(case, config)
        if isinstance(ready, str):
            return Outcome(check=self.name, status="n/a", detail=ready)
        assert ready.batch is not None and ready.seq_len is not None, "the case resolves batch and seq_len"
        shards = ready.seq_shards
        if shards is None:
            from sp_harness.config.shards import chunk_sizes

            shards = tuple(chunk_sizes(ready.seq_len, ready.tp))
        # one rank holding every sequence of the n-rank run's global batch, masked as that run is
        one = prepared(case, ready.replace(world_size=1, dp=1, seq_shards=None, batch=ready.dp * ready.batch))
        if isinstance(one, str):
            return Outcome(check=self.name, status="n/a", detail=f"one rank: {one}")
        label = f"case {config.case} [{ready.short()}] ({self.name})"
        try:
            many = run_variant(runner, InvariancePayload(config=ready), label)
            single = run_variant(runner, InvariancePayload(config=one, mask_mesh=(ready.dp, ready.tp, tuple(shards))),
                                 label + " on 1 rank")
        except RankFailure as exc:
            return outcome(self.name, ready, None, error=exc, t0=t0)
        figures = compare(many.micro, single.micro, f"dp={ready.dp} x tp={ready.tp}", "1 rank")
        return outcome(self.name, ready, figures, t0=t0)

    def render(self, outcome: Outcome) -> str:
        return render(outcome)


CHECK = DegreeInvariance()
