"""Stage: checks. Degree invariance: the case's own step on its mesh against the same step on one
rank, over the same global batch (the same sequences, the same tokens without loss) and from the
same params. A step that normalises by a rank's own token count, scales by a parallel degree or
skips a group's grad sync fails here, without a reference model to trust."""

from __future__ import annotations

from sp_harness.checks.invariance import (
    InvarianceCheck,
    InvarianceFigures,
    TwinCrashed,
    compare,
    prepared,
    run_variant,
)
from sp_harness.checks.invariance_rank import InvariancePayload
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.shards import chunk_sizes
from sp_harness.launch.failure import RankFailure
from sp_harness.launch.runner import Runner


class DegreeInvariance(InvarianceCheck):
    name = "degree-invariance"
    label = "degree invariance"

    def why_not(self, config: CheckConfig) -> str | None:
        return "world_size 1: no parallel degree to compare with 1" if config.world_size < 2 else None

    def compare_runs(self, case: Case, ready: CheckConfig, runner: Runner, label: str) -> InvarianceFigures | str:
        assert ready.batch is not None and ready.seq_len is not None, "the case resolves batch and seq_len"
        shards = ready.seq_shards or tuple(chunk_sizes(ready.seq_len, ready.tp))
        # one rank holding every sequence of the n-rank run's global batch, masked as that run is
        one = prepared(case, ready.replace(world_size=1, dp=1, seq_shards=None, batch=ready.dp * ready.batch))
        if isinstance(one, str):
            return f"one rank: {one}"
        many = run_variant(runner, InvariancePayload(config=ready), label)
        try:
            single = run_variant(runner, InvariancePayload(config=one, mask_mesh=(ready.dp, ready.tp, tuple(shards))),
                                 label + " on 1 rank")
        except RankFailure as exc:
            if exc.in_setup or all(e.is_unsupported for e in exc.errors):
                raise  # the check's usual n/a or setup error
            raise TwinCrashed(f"the step ran at dp={ready.dp} x tp={ready.tp} and crashed on one rank, the check's "
                              f"twin of it: {exc.one_line()} (a step written only for its parallel path, say one "
                              f"that reads an SP adapter's inputs, cannot be compared with one rank)") from exc
        return compare(many.micro, single.micro, f"dp={ready.dp} x tp={ready.tp}", "1 rank")


CHECK = DegreeInvariance()
