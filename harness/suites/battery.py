"""Stage: suites. The mutant catalogue run: does the default battery kill
every realistic broken SP implementation?

Every mutant gets the same default battery, in order, never tuned per mutant: side-by-side
checks at an even split, an uneven split, a 2 x 2 DP x TP mesh (even, then uneven), the
[s, b, h] layout; for a case that declares its own training step, that step (sp_harness.checks.train_step);
the collective accounting against the paper (SP must move what TP moves); the
activation-memory check (where sp_harness.checks.activation_memory provides it); a short lockstep convergence run
through the gate; non-causal attention at an uneven split; for context-parallel cases that
claim causal load balancing, the work each rank's attention reports (sp_harness.checks.balance);
and 4 ranks of one replica (for a hybrid Ulysses x ring case, both degrees 2); last, a bfloat16
run past 256 tokens, for bugs that are exact in float32/64. A battery entry counts toward a kill only if the mutant's correct twin
(`Case.twin`) passes it, so a kill is never an artefact of the config. The first entry that
fails is the killer; its check (forward, grad, param-after-step, replica drift, crash, collective
accounting, activation memory, lockstep gate) and config are reported.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sp_harness.checks import Outcome, get_check, run_check
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import all_cases, get_case

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner


@dataclass(kw_only=True, frozen=True)
class Entry:
    name: str
    """Short label in the table."""
    check: str
    """Name of the check it runs (sp_harness.checks)."""
    fields: tuple = ()
    """CheckConfig fields (as pairs) on top of the case defaults."""

    def config(self, case: str) -> CheckConfig:
        return CheckConfig(case=case, **dict(self.fields))


BATTERY: tuple[Entry, ...] = (
    Entry(name="even", check="side-by-side", fields=(("world_size", 2),)),
    Entry(name="uneven", check="side-by-side", fields=(("world_size", 3), ("seq_len", 10))),
    Entry(name="dp2xtp2", check="side-by-side", fields=(("world_size", 4), ("dp", 2))),
    Entry(name="dp2xtp2-uneven", check="side-by-side", fields=(("world_size", 4), ("dp", 2), ("seq_len", 7))),
    Entry(name="sbh", check="side-by-side", fields=(("world_size", 2), ("layout", "sbh"))),
    # the case's own training step (cases that declare one): K = 3 uneven micro-batches on a
    # 2 x 2 mesh, SGD (AdamW would hide a uniform grad scale), clipping active. Before the
    # lockstep entry, which trains a case's own step too: the stage that names the bug comes first
    Entry(name="train-step", check="train-step",
          fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 3), ("optimizer", "sgd"),
                  ("clip_grad_norm", 0.01))),
    # the same in float32, for frameworks whose step refuses float64 (DeepSpeed's engine), and on
    # two data-parallel ranks alone, for steps with no sequence parallelism (the HF Trainer's)
    Entry(name="train-step-f32", check="train-step",
          fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 3), ("optimizer", "sgd"),
                  ("clip_grad_norm", 0.01), ("dtype", "float32"))),
    Entry(name="train-step-dp", check="train-step",
          fields=(("world_size", 2), ("dp", 2), ("train_step", True), ("micro_batches", 3), ("optimizer", "sgd"),
                  ("clip_grad_norm", 0.01), ("dtype", "float32"))),
    # DP 2 x SP 2 at K = 2, for steps whose micro-batches must be a multiple of SP (the HF
    # Trainer over DeepSpeed's SP data-loader adapter: one batch from each SP rank per round)
    # Two steps, not three: its SP mutants are off from step 0, and its 4-rank SP steps (DeepSpeed's
    # engine under the Trainer) are the battery's slowest
    Entry(name="train-step-sp", check="train-step",
          fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 2), ("optimizer", "sgd"),
                  ("clip_grad_norm", 0.01), ("dtype", "float32"), ("steps", 2))),
    Entry(name="comm-vs-tp", check="comm-vs-baseline", fields=(("world_size", 2),)),
    Entry(name="memory", check="activation-memory", fields=(("world_size", 2),)),
    Entry(name="lockstep", check="lockstep", fields=(("world_size", 2),)),
    # cases that implement only causal attention declare this UNSUPPORTED: n/a, not a kill
    Entry(name="noncausal", check="side-by-side", fields=(("world_size", 3), ("seq_len", 10), ("causal", False))),
    Entry(name="balance", check="load-balance", fields=(("world_size", 4), ("seq_len", 16))),
    # 4 ranks of one replica: for a hybrid case the only entry with Ulysses and ring degrees both 2
    Entry(name="2x2", check="side-by-side", fields=(("world_size", 4),)),
    # bfloat16 past 256 tokens, where bf16 stops holding every integer: position ids that pass
    # through the run dtype alias there. 290 = 2 mod 4: the last id (289) rounds down to 288,
    # inside the position table (a real model's table is longer than its sequence), so an
    # aliasing bug shows as wrong numbers, not as an out-of-range index
    Entry(name="bf16", check="side-by-side", fields=(("world_size", 2), ("dtype", "bfloat16"), ("seq_len", 290))),
)


@dataclass(kw_only=True)
class MutantOutcome:
    mutant: str
    models_bug: str
    status: str
    """KILLED, SURVIVED, or BATTERY-ERROR (the correct twin failed an entry it must pass, or the
    twin or the mutant could not run it, verdict ERROR: the battery, not the mutant, is broken
    there, and a kill would not mean what it says)."""
    killed_by: str = ""
    entry: str = ""
    config: str = ""
    repro: str = ""
    detail: str = ""
    seconds: float = 0.0
    twin_failures: tuple[str, ...] = ()
    """Entries the correct twin failed (each one a battery error)."""


class Battery:
    """Runs entries for cases, caching the correct twins' outcomes."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._twin: dict[tuple[str, str], Outcome] = {}

    def evaluate(self, case_name: str, entry: Entry) -> Outcome:
        return run_check(get_check(entry.check), entry.config(case_name), self.runner)

    def twin_outcome(self, twin: str, entry: Entry) -> Outcome:
        key = (twin, entry.name)
        if key not in self._twin:
            self._twin[key] = self.evaluate(twin, entry)
        return self._twin[key]

    def kill(self, mutant: str, *, only: str | None = None) -> MutantOutcome:
        """The battery's entries in order until one kills `mutant`; `only`: that entry alone (the
        pinned kill, without proving that no earlier entry kills it: the fast test tier's)."""
        entries = BATTERY if only is None else tuple(e for e in BATTERY if e.name == only)
        if not entries:
            raise ValueError(f"no battery entry {only!r}; entries: {', '.join(e.name for e in BATTERY)}")
        case = get_case(mutant)
        if not case.twin:
            raise ValueError(f"{mutant} names no correct twin (Case.twin)")
        t0 = time.perf_counter()
        twin_failures = []
        for entry in entries:
            twin = self.twin_outcome(case.twin, entry)
            if twin.passed is False or twin.status == "error":
                verb = "fails" if twin.passed is False else "could not run (ERROR)"
                twin_failures.append(f"{case.twin} {verb} entry {entry.name}: {twin.detail}")
                continue
            if twin.passed is None:
                continue
            outcome = self.evaluate(mutant, entry)
            if outcome.status == "error":
                # a mutant that cannot be set up proves nothing about the entry: never a kill
                twin_failures.append(f"{mutant} could not run (ERROR) entry {entry.name}: {outcome.detail}")
                break
            if outcome.passed is False:
                if twin_failures:
                    break
                return MutantOutcome(mutant=mutant, models_bug=case.models_bug, status="KILLED",
                                     killed_by=outcome.caught_by, entry=entry.name,
                                     config=", ".join(f"{k}={v}" for k, v in entry.fields), repro=outcome.repro,
                                     detail=outcome.detail, seconds=time.perf_counter() - t0)
        if twin_failures:
            return MutantOutcome(mutant=mutant, models_bug=case.models_bug, status="BATTERY-ERROR",
                                 detail="; ".join(twin_failures), twin_failures=tuple(twin_failures),
                                 seconds=time.perf_counter() - t0)
        return MutantOutcome(mutant=mutant, models_bug=case.models_bug, status="SURVIVED",
                             seconds=time.perf_counter() - t0)


def mutant_names() -> list[str]:
    """The catalogue (the scaled sensitivity mutants are measured by `sp-harness sensitivity`)."""
    return sorted(n for n, c in all_cases().items() if "mutant" in c.tags and "scaled" not in c.tags)


def format_table(outcomes: list[MutantOutcome]) -> str:
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
    p.add_argument("--json", metavar="FILE", help="write every mutant's outcome as JSON")
    p.add_argument("--only", nargs="*", help="mutant names (default: all)")
    p.set_defaults(func=cmd_mutants)
