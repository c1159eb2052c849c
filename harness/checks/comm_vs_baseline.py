"""Stage: checks. Communication volume of an SP case against its TP baseline (`Case.baseline`):
Korthikanti et al. 2022 (section 4.2.2) say SP replaces each all-reduce by a reduce-scatter plus
an all-gather of the same payload, so per step and rank the volume is equal. Judged on even
shards only: uneven ones are padded to the largest shard, which legitimately moves more (the
figures are still reported)."""

from __future__ import annotations

from sp_harness.checks.base import Outcome, not_applicable
from sp_harness.checks.side_by_side import check
from sp_harness.compare.comm_volume import PaperComparison, paper_check
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.config.shards import chunk_sizes, is_even
from sp_harness.judge.verdict import PASS
from sp_harness.launch.runner import Runner


def _shards(config: CheckConfig) -> tuple[int, ...]:
    """Tokens per TP rank: the explicit shards, else torch.chunk's split of seq_len."""
    if config.seq_shards:
        return config.seq_shards
    assert config.seq_len is not None, f"no seq_len to split [{config.short()}] (Case.resolve fills it)"
    return chunk_sizes(config.seq_len, config.tp)


def padding_note(config: CheckConfig, fig: PaperComparison) -> str:
    """Why uneven shards move more than TP: the collectives pad every shard to the largest."""
    if fig.matches or not fig.tp_ring_bytes:
        return ""
    sizes = _shards(config)
    if is_even(sizes):
        return ""
    return (f"; uneven shards {'/'.join(map(str, sizes))} are padded to {max(sizes)} tokens per rank "
            f"({config.tp} x {max(sizes)} = {config.tp * max(sizes)} vs {sum(sizes)})")


class CommVsBaseline:
    name = "comm-vs-baseline"
    label = "collective accounting"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        if not case.baseline or case.baseline == case.name:
            return f"{case.name} declares no TP baseline"
        if config.tp <= 1:
            return "tp = 1: no TP collectives to compare"
        return None

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        case = get_case(config.case)
        sp = check(config, runner)
        tp = check(config.replace(case=case.baseline), runner)
        if sp.verdict != PASS or tp.verdict != PASS or not sp.comm or not tp.comm:
            return not_applicable(self.name, f"no figures ({sp.config.case} {sp.verdict}, {case.baseline} {tp.verdict})")
        fig = paper_check(tp.comm, sp.comm, tp=sp.config.tp)
        detail = fig.describe() + padding_note(sp.config, fig)
        if not is_even(_shards(sp.config)):
            return Outcome(check=self.name, status="n/a", detail=detail, figures=fig)
        return Outcome(check=self.name, status="pass" if fig.matches else "fail",
                       caught_by="" if fig.matches else self.label, detail=detail, repro=sp.config.repro(), figures=fig)

    def render(self, outcome: Outcome) -> str:
        return outcome.detail


CHECK = CommVsBaseline()
