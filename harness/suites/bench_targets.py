"""Stage: suites. The project's speed and memory targets for `sp-harness bench` (docs/benchmarks.md), each with the
figure a run measured for it: MET, or MISSED and by what factor. Pure: reads a bench result."""

from __future__ import annotations

import dataclasses

from sp_harness.config.registry import get_case

SUBJECT = "megatron-gpt-sp"
"""The case the targets' figures are about (scaling, memory, communication, the realistic sizes);
its TP baseline and memory mutants come from case attributes."""
TARGET_SPEEDUP_SEED = 200.0
TARGET_SPEEDUP = 50.0
TARGET_OVERHEAD = 1.5
TARGET_CONVERGE_S = 180.0
TARGET_BIG = 3.0
TARGET_MEMORY = 2.0
TARGET_SUITE_S = 300.0
BIG = (1024, 2048)
"""(hidden, seq_len) of the big cell: its target is TARGET_BIG at 2 ranks."""


def speedup_target(case: str) -> float:
    """The warm-pool target at 4 ranks: 200x for the seed's toy, 50x for the GPT."""
    return TARGET_SPEEDUP_SEED if "seed" in get_case(case).tags else TARGET_SPEEDUP


@dataclasses.dataclass(kw_only=True, frozen=True)
class Target:
    """One of the targets, with the figure measured for it."""

    name: str
    value: float
    limit: float
    at_most: bool
    """True: the figure must not exceed the limit (a cost); False: must reach it (a speedup)."""
    unit: str = "x"

    @property
    def met(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    @property
    def factor(self) -> float:
        """How far the figure is from the limit, >= 1 where missed."""
        return self.value / self.limit if self.at_most else self.limit / self.value

    def line(self) -> str:
        rel = "<=" if self.at_most else ">="
        verdict = "MET" if self.met else f"MISSED by {self.factor:.2f}x"
        return f"  {self.name}: {self.value:.2f}{self.unit} vs {rel} {self.limit:g}{self.unit}: {verdict}"


def targets(r: dict) -> list[Target]:
    """Every target the run has a figure for: the bench's and (when run) the realistic sizes'."""
    found = [Target(name=f"warm pool vs spawn-per-example, {key[:-2]} at 4 ranks", value=sp["speedup"],
                    limit=speedup_target(key[:-2]), at_most=False)
             for key, sp in r["spawn"].items() if key.endswith("@4") and "speedup" in sp]
    found += [Target(name=f"overhead {key} (small default sizes)", value=o["check_s"] / o["bare_s"],
                     limit=TARGET_OVERHEAD, at_most=True) for key, o in r["overhead"].items()]
    c = r["converge"]
    found.append(Target(name=f"convergence job ({c['steps']} steps{'' if c['steps'] == 200 else ', not the default 200'})",
                        value=c["s"], limit=TARGET_CONVERGE_S, at_most=True, unit="s"))
    worst = worst_memory_ratio(r)
    found.append(Target(name="activation memory, worst |measured/adjusted - 1|", value=100 * worst, limit=5.0,
                        at_most=True, unit="%"))
    if r.get("realistic"):
        found += realistic_targets(r["realistic"])
    if "train" in r:
        from sp_harness.suites.bench_train import TARGET_RATIO

        found.append(Target(name="training-step check vs side-by-side (same config and K)", value=r["train"]["ratio"],
                            limit=TARGET_RATIO, at_most=True))
    return found


def realistic_targets(r: dict) -> list:
    """The targets at realistic sizes, each with its figure."""
    found = []
    for row in r["cost"]:
        big = (row["hidden"], row["seq_len"]) == BIG
        if big and row["world_size"] != 2:
            continue
        found.append(Target(name=f"overhead {row['case']} ws={row['world_size']} hidden {row['hidden']} "
                                 f"seq {row['seq_len']}" + (f" ({SUBJECT} at the big size)" if big else ""),
                            value=row["ratio"], limit=TARGET_BIG if big else TARGET_OVERHEAD, at_most=True))
    found += [Target(name=f"peak memory per rank vs bare, ws={row['world_size']}", value=row["ratio"],
                     limit=TARGET_MEMORY, at_most=True) for row in r["memory"]]
    if r["suite_s"] is not None:
        found.append(Target(name="test suite, pytest -n auto", value=r["suite_s"], limit=TARGET_SUITE_S, at_most=True,
                            unit="s"))
    return found


def worst_memory_ratio(r: dict) -> float:
    return max((row.get("worst_ratio_all_ranks", abs(row.get("ratio", 1) - 1)) for row in r["memory"]
                if row["mode"] != "mutant"), default=0.0)


def format_targets(r: dict) -> str:
    L = ["targets (one run; ratios within a row measured in the same run)"]
    L += [t.line() for t in targets(r)]
    L += ["  why: a verified example IS the check: three references (float64; the run dtype with an order-error matmul",
          "  error; a float64 copy under a TorchDispatchMode that perturbs every op's inputs and result), each once per",
          "  example on its owner rank and broadcast, then every output/grad/param judged on every rank; bare_rank runs",
          "  one float64 reference. See (i) for where the time goes. Spawn-per-example is pool start + first job."]
    return "\n".join(L)
