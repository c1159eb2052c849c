"""Stage: gate (of the harness itself). The mutant catalogue run: does the default battery kill
every realistic broken SP implementation?

Every mutant gets the same default battery, in order, never tuned per mutant: side-by-side
checks at an even split, an uneven split, a 2 x 2 DP x TP mesh (even, then uneven), the
[s, b, h] layout; the collective accounting against the paper (SP must move what TP moves); the
activation-memory check (where sp_harness.checks.memory provides it); and a short lockstep convergence run
through the gate. A battery entry counts toward a kill only if the mutant's correct twin
(`Case.twin`) passes it, so a kill is never an artefact of the config. The first entry that
fails is the killer; its check (forward, grad, param-after-step, replica drift, crash, collective
accounting, activation memory, lockstep gate) and config are reported.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from sp_harness.config.case import all_cases, get_case
from sp_harness.config.check_config import CheckConfig

KIND_LABEL = {"init": "init", "forward": "forward", "loss": "forward (loss)", "input_grad": "input grad", "grad": "grad",
              "param": "param-after-step"}


@dataclass(kw_only=True, frozen=True)
class Entry:
    name: str
    """Short label in the table."""
    kind: str
    """'check', 'comm', 'memory' or 'converge'."""
    fields: tuple = ()
    """CheckConfig fields (as pairs) on top of the case defaults."""


BATTERY: tuple[Entry, ...] = (
    Entry(name="even", kind="check", fields=(("world_size", 2),)),
    Entry(name="uneven", kind="check", fields=(("world_size", 3), ("seq_len", 10))),
    Entry(name="dp2xtp2", kind="check", fields=(("world_size", 4), ("dp", 2))),
    Entry(name="dp2xtp2-uneven", kind="check", fields=(("world_size", 4), ("dp", 2), ("seq_len", 7))),
    Entry(name="sbh", kind="check", fields=(("world_size", 2), ("layout", "sbh"))),
    Entry(name="comm-vs-tp", kind="comm", fields=(("world_size", 2),)),
    Entry(name="memory", kind="memory", fields=(("world_size", 2),)),
    Entry(name="lockstep", kind="converge", fields=(("world_size", 2),)),
)


@dataclass(kw_only=True)
class Outcome:
    mutant: str
    models_bug: str
    status: str
    """KILLED, SURVIVED, or BATTERY-ERROR (the correct twin failed an entry it must pass: the
    battery, not the mutant, is broken there, and the kill would not mean what it says)."""
    killed_by: str = ""
    entry: str = ""
    config: str = ""
    repro: str = ""
    detail: str = ""
    seconds: float = 0.0
    twin_failures: tuple[str, ...] = ()
    """Entries the correct twin failed (each one a battery error)."""


def _config(case: str, entry: Entry) -> CheckConfig:
    return CheckConfig(case=case, **dict(entry.fields))


def _run_check(case: str, entry: Entry, runner):
    from sp_harness.checks.verify import check

    return check(_config(case, entry), runner)


def _killer_of(res) -> str:
    kind = res.first_check
    return KIND_LABEL.get(kind, kind) or "?"


def _comm_verdict(case: str, base_tp: str, entry: Entry, runner):
    """(ok, detail): SP activation collectives must equal the TP twin's volume (the paper)."""
    from sp_harness.capture.comm import paper_check
    from sp_harness.checks.verify import check

    sp = check(_config(case, entry), runner)
    tp = check(_config(base_tp, entry), runner)
    if sp.verdict != "PASS" or tp.verdict != "PASS" or not sp.comm or not tp.comm:
        return None, f"no figures (sp {sp.verdict}, tp {tp.verdict})"
    fig = paper_check(tp.comm, sp.comm, tp=sp.config.tp)
    return fig["matches"], (f"TP ring bytes/rank {fig['tp_ring_bytes']:.0f} vs SP {fig['sp_ring_bytes']:.0f}; "
                            f"AR {fig['tp_all_reduce']['count']} vs AG {fig['sp_all_gather']['count']} + "
                            f"RS {fig['sp_reduce_scatter']['count']}")


def _memory_verdict(case: str, entry: Entry, runner):
    try:
        from sp_harness.checks import memory
    except ModuleNotFoundError:
        return None, "sp_harness.checks.memory not available"
    gate = getattr(memory, "memory_gate", None)
    if gate is None:
        return None, "no memory gate"
    return gate(_config(case, entry), runner)


def _converge_verdict(case: str, baseline: str, entry: Entry, runner, out_dir: str):
    """(passed, detail, repro line) of a short lockstep convergence run through the gate."""
    from sp_harness.suites.converge import ConvergeOptions, converge, repro_line

    opts = ConvergeOptions(case=case, baseline=baseline, world_size=dict(entry.fields)["world_size"], steps=6,
                           seq_len=12, batch=2, warmup_steps=2)
    result, _, _ = converge(opts, runner, out_dir, progress=False)
    first = result.first_failure
    detail = f"first failing step {result.first_failing_step}, {result.first_failing_metric}" if first else ""
    if first is not None and result.first_failing_param:
        detail += f" ({result.first_failing_param})"
    return result.passed, detail, repro_line("converge", opts)


class Battery:
    """Runs entries for cases, caching the correct twins' outcomes."""

    def __init__(self, runner, work_dir: str = "reports/mutants"):
        self.runner = runner
        self.work_dir = work_dir
        self._twin: dict[tuple[str, str], tuple[bool | None, str]] = {}

    def _evaluate(self, case_name: str, entry: Entry):
        """(passed: bool | None, killer label, detail, repro). None: not applicable."""
        case = get_case(case_name)
        family_tp = "megatron-gpt-tp" if "megatron" in case.tags or case_name.startswith("megatron") else None
        if entry.kind == "check":
            res = _run_check(case_name, entry, self.runner)
            if res.verdict == "UNSUPPORTED":
                return None, "", res.reason, res.config.repro()
            return res.verdict == "PASS", _killer_of(res) if res.verdict == "FAIL" else "", \
                (res.first_failure if res.verdict == "FAIL" else ""), res.config.repro()
        if entry.kind == "comm":
            if family_tp is None or case_name == family_tp or get_case(case_name).twin.endswith("-tp"):
                return None, "", "no TP twin", ""
            ok, detail = _comm_verdict(case_name, family_tp, entry, self.runner)
            return ok, "collective accounting", detail, ""
        if entry.kind == "memory":
            ok, detail = _memory_verdict(case_name, entry, self.runner)
            return ok, "activation memory", detail, ""
        if entry.kind == "converge":
            if family_tp is None:
                return None, "", "no convergence setup for this family", ""
            ok, detail, repro = _converge_verdict(case_name, family_tp, entry, self.runner,
                                                  f"{self.work_dir}/{case_name}")
            return ok, "lockstep gate", detail, repro
        raise AssertionError(entry.kind)

    def twin_outcome(self, base: str, entry: Entry) -> tuple[bool | None, str]:
        """(passed, detail) of the correct twin on `entry`; None: not applicable to it."""
        key = (base, entry.name)
        if key not in self._twin:
            passed, _, detail, _ = self._evaluate(base, entry)
            self._twin[key] = (passed, detail)
        return self._twin[key]

    def kill(self, mutant: str) -> Outcome:
        case = get_case(mutant)
        if not case.twin:
            raise ValueError(f"{mutant} names no correct twin (Case.twin)")
        t0 = time.perf_counter()
        twin_failures = []
        for entry in BATTERY:
            twin_passed, twin_detail = self.twin_outcome(case.twin, entry)
            if twin_passed is False:
                twin_failures.append(f"{case.twin} fails entry {entry.name}: {twin_detail}")
                continue
            if twin_passed is None:
                continue
            passed, killer, detail, repro = self._evaluate(mutant, entry)
            if passed is False:
                if twin_failures:
                    break
                return Outcome(mutant=mutant, models_bug=case.models_bug, status="KILLED", killed_by=killer,
                               entry=entry.name, config=", ".join(f"{k}={v}" for k, v in entry.fields),
                               repro=repro, detail=detail, seconds=time.perf_counter() - t0)
        if twin_failures:
            return Outcome(mutant=mutant, models_bug=case.models_bug, status="BATTERY-ERROR",
                           detail="; ".join(twin_failures), twin_failures=tuple(twin_failures),
                           seconds=time.perf_counter() - t0)
        return Outcome(mutant=mutant, models_bug=case.models_bug, status="SURVIVED",
                       seconds=time.perf_counter() - t0)


def mutant_names() -> list[str]:
    """The catalogue (the scaled sensitivity mutants are measured by `sp-harness sensitivity`)."""
    return sorted(n for n, c in all_cases().items() if "mutant" in c.tags and "scaled" not in c.tags)


def format_table(outcomes: list[Outcome]) -> str:
    width = max(len(o.mutant) for o in outcomes)
    lines = [f"{'mutant':<{width}}  {'status':<8} {'killed by':<22} {'battery entry':<15} {'time':>6}  bug modelled"]
    for o in outcomes:
        bug = o.models_bug.split(":")[0].split(" (")[0][:70]
        lines.append(f"{o.mutant:<{width}}  {o.status:<8} {o.killed_by:<22} {o.entry:<15} {o.seconds:>5.1f}s  {bug}")
    killed = sum(o.status == "KILLED" for o in outcomes)
    lines.append(f"mutation score: {killed}/{len(outcomes)} killed = {100.0 * killed / max(1, len(outcomes)):.1f}%")
    return "\n".join(lines)


def cmd_mutants(args) -> int:
    from sp_harness.launch.runner import runner as _runner

    names = args.only or mutant_names()
    battery = Battery(_runner())
    outcomes = []
    for name in names:
        outcome = battery.kill(name)
        outcomes.append(outcome)
        if outcome.twin_failures:
            print(f"  battery error: {outcome.detail}", flush=True)
        print(f"  {outcome.status:<8} {name:<40} {outcome.killed_by:<22} {outcome.entry:<15} {outcome.seconds:.1f}s",
              flush=True)
    print(format_table(outcomes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=1)
    return 0 if all(o.status == "KILLED" for o in outcomes) else 1


def add_subcommands(sub) -> None:
    p = sub.add_parser("mutants", help="run the default battery against every mutant; exit 1 if any survives")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--only", nargs="*", help="mutant names (default: all)")
    p.set_defaults(func=cmd_mutants)
