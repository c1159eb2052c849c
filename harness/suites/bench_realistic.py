"""Stage: suites. The benchmark at realistic sizes (issue 14): what one verified example costs
against the bare compute of the same models, per rank peak memory against bare, and the test
suite's wall time. Ratios are from one run each (a warm pool; the first job at a size is a
warm-up, not timed).

  cost      time of `check(config)` / time of `bare_rank(config)` (build reference + sharded,
            forward / backward / grad sync / optimizer step on both, nothing captured or compared)
  memory    peak resident set size per rank (ru_maxrss) of a fresh pool after a check, against a
            fresh pool after the bare job, minus what a fresh pool holds after its warm-up
  suite     wall time of `python -m pytest -n auto -q` in the repository (full runs; `--no-suite`
            skips it)
  profile   where one verified example of the subject goes, per rank and stage
            (sp_harness.suites.bench_profile), at the first GPT size and 2 ranks
"""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sp_harness.config.case import Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import all_cases, get_case
from sp_harness.suites.bench_targets import BIG, SUBJECT

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner

GPT_SIZES = ((256, 512), (1024, 2048), (1024, 512), (256, 2048))
"""(hidden, seq_len) of the GPT cells: 4 layers, float32, head_dim 64, ffn 4h, one sequence."""


@dataclass(kw_only=True, frozen=True)
class CostRow:
    case: str
    world_size: int
    hidden: int
    seq_len: int
    check_s: float
    bare_s: float
    verdict: str

    @property
    def ratio(self) -> float:
        return self.check_s / self.bare_s if self.bare_s else float("inf")


@dataclass(kw_only=True, frozen=True)
class MemoryRow:
    case: str
    world_size: int
    hidden: int
    seq_len: int
    baseline_mib: float
    """Peak RSS per rank (max over ranks) of a fresh pool after its warm-up: imports, groups."""
    bare_mib: float
    check_mib: float

    @property
    def ratio(self) -> float:
        """Peak per rank above the baseline, check / bare."""
        return (self.check_mib - self.baseline_mib) / max(1e-9, self.bare_mib - self.baseline_mib)


def realistic_config(case: str, world_size: int, hidden: int, seq_len: int) -> CheckConfig:
    return CheckConfig(case=case, world_size=world_size, hidden=hidden, seq_len=seq_len, num_heads=max(1, hidden // 64),
                       ffn=4 * hidden, num_layers=4, vocab=64, batch=1, dtype="float32", timeout_s=3600.0)


def runnable(config: CheckConfig) -> CheckConfig | None:
    """The resolved config where the case runs it and is expected to PASS (None where it declares
    it UNSUPPORTED, or pins an upstream failure there: a crash has no cost per verified example)."""
    from sp_harness.judge.expect import expected_verdict

    case = get_case(config.case)
    try:
        resolved = case.resolve(config)
        case.validate(resolved)
    except (Unsupported, ValueError):
        return None
    return resolved if expected_verdict(resolved) == "PASS" else None


def peak_rss_mib(_: object = None) -> float:
    """Rank job: the peak resident set size so far, MiB (Linux reports KiB), of this process plus
    its reference process (sp_harness.checks.refproc), where the check's references live."""
    import sys

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    refproc = sys.modules.get("sp_harness.checks.refproc")
    child = getattr(refproc, "_PROCESS", None)
    if child is None or child.proc.poll() is not None:
        return own
    try:
        with open(f"/proc/{child.proc.pid}/status") as f:
            hwm = next((line.split()[1] for line in f if line.startswith("VmHWM:")), "0")
    except OSError:
        return own
    return own + int(hwm) / 1024.0


def cost_row(config: CheckConfig, runner: Runner) -> CostRow:
    from sp_harness.checks.side_by_side import check
    from sp_harness.suites.bench_bare import timed_bare

    t0 = time.perf_counter()
    res = check(config, runner)
    check_s = time.perf_counter() - t0
    bare_s = timed_bare(config, runner, 1)[0]
    assert config.hidden is not None and config.seq_len is not None, "realistic_config sets hidden and seq_len"
    return CostRow(case=config.case, world_size=config.world_size, hidden=config.hidden, seq_len=config.seq_len,
                   check_s=check_s, bare_s=bare_s, verdict=res.verdict)


def memory_row(config: CheckConfig) -> MemoryRow:
    """Fresh pools, so each peak is that job's alone."""
    from sp_harness.checks.side_by_side import check
    from sp_harness.launch.manager import PoolManager
    from sp_harness.suites.bench_bare import bare_rank

    def fresh(job) -> tuple[float, float]:
        manager = PoolManager(max_pools=1)
        try:
            # case=: the same processes as the job's (a case of its own isolation gets its own)
            base = max(manager.run(config.world_size, peak_rss_mib, None,
                                   timeout_s=600, label="bench rss", case=config.case))
            job(manager)
            return base, max(manager.run(config.world_size, peak_rss_mib, None,
                                         timeout_s=600, label="bench rss", case=config.case))
        finally:
            manager.close()

    base_bare, bare = fresh(lambda m: m.run(config.world_size, bare_rank, config,
                                            timeout_s=config.timeout_s, label="bench bare", case=config.case))
    base_check, checked = fresh(lambda m: check(config, m))
    assert config.hidden is not None and config.seq_len is not None, "realistic_config sets hidden and seq_len"
    return MemoryRow(case=config.case, world_size=config.world_size, hidden=config.hidden, seq_len=config.seq_len,
                     baseline_mib=min(base_bare, base_check), bare_mib=bare, check_mib=checked)


def suite_seconds(repo: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-n", "auto", "-q", "-p", "no:cacheprovider"], cwd=repo,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def built_in_cases() -> list[str]:
    return sorted(n for n, c in all_cases().items() if "mutant" not in c.tags)


def _cost_rows(manager, world_sizes: tuple[int, ...], gpt_sizes: tuple[tuple[int, int], ...], log) -> list[CostRow]:
    cost = []
    for ws in world_sizes:
        for case in built_in_cases():
            for hidden, seq_len in gpt_sizes if case == SUBJECT else gpt_sizes[:1]:
                if (hidden, seq_len) == BIG and ws != 2:
                    continue  # the big cell's target is at 2 ranks; 4 ranks of it exceed this machine's time
                config = runnable(realistic_config(case, ws, hidden, seq_len))
                if config is None:
                    continue
                row = cost_row(config, manager)
                cost.append(row)
                log(f"  cost {case} ws={ws} h={hidden} s={seq_len}: check {row.check_s:.2f}s bare "
                    f"{row.bare_s:.2f}s = {row.ratio:.2f}x ({row.verdict})")
    return cost


def profile_subject(*, quick: bool, size: tuple[int, int] | None = None, manager=None) -> dict:
    """(i): one profiled check of the subject at 2 ranks (the first GPT size; quick: a small one)."""
    from sp_harness.launch.manager import PoolManager
    from sp_harness.suites.bench_profile import run_profile

    hidden, seq_len = size or ((128, 64) if quick else GPT_SIZES[0])
    own = manager is None
    manager = manager or PoolManager(max_pools=1)
    try:
        config = runnable(realistic_config(SUBJECT, 2, hidden, seq_len))
        assert config is not None, f"{SUBJECT} runs, and passes, at its realistic sizes"
        return run_profile(config, manager)
    finally:
        if own:
            manager.close()


def run_realistic(*, quick: bool, suite: bool, log=print, world_sizes: tuple[int, ...] | None = None,
                  gpt_sizes: tuple[tuple[int, int], ...] | None = None) -> dict:
    """The realistic-size figures; `world_sizes` and `gpt_sizes` override the defaults (tests)."""
    from sp_harness.launch.manager import PoolManager
    world_sizes = world_sizes or ((2,) if quick else (2, 4))
    gpt_sizes = gpt_sizes or (GPT_SIZES[:1] if quick else GPT_SIZES)
    manager = PoolManager(max_pools=1)
    try:
        cost = _cost_rows(manager, world_sizes, gpt_sizes, log)
        profile = profile_subject(quick=quick, size=gpt_sizes[0], manager=manager)
    finally:
        manager.close()
    memory = []
    for ws in world_sizes:
        config = runnable(realistic_config(SUBJECT, ws, *gpt_sizes[0]))
        assert config is not None, f"{SUBJECT} runs, and passes, at its realistic sizes"
        memory.append(memory_row(config))
        log(f"  memory {SUBJECT} ws={ws}: ratio {memory[-1].ratio:.2f}x")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    suite_s = suite_seconds(repo) if suite else None
    return {"cost": [dataclasses.asdict(r) | {"ratio": r.ratio} for r in cost],
            "memory": [dataclasses.asdict(r) | {"ratio": r.ratio} for r in memory], "suite_s": suite_s,
            "profile": profile, "gpt_sizes": [list(s) for s in gpt_sizes]}


def format_realistic(r: dict) -> str:
    from sp_harness.suites.bench_profile import format_profile

    L = ["(f) cost per verified example at realistic sizes (4 layers, float32, head_dim 64, ffn 4h, batch 1, "
         "3 steps): check / bare compute, one run each",
         f"  {'case':<18} {'ws':>3} {'hidden':>6} {'seq':>5} {'check s':>9} {'bare s':>9} {'ratio':>7}  verdict"]
    for row in r["cost"]:
        L.append(f"  {row['case']:<18} {row['world_size']:>3} {row['hidden']:>6} {row['seq_len']:>5} "
                 f"{row['check_s']:>9.2f} {row['bare_s']:>9.2f} {row['ratio']:>6.2f}x  {row['verdict']}")
    hidden, seq_len = r["gpt_sizes"][0]
    L.append(f"(g) peak resident memory per rank above a fresh pool's ({SUBJECT}, hidden {hidden}, seq {seq_len})")
    for row in r["memory"]:
        L.append(f"  ws={row['world_size']}: fresh pool {row['baseline_mib']:.0f} MiB, bare {row['bare_mib']:.0f} MiB, "
                 f"check {row['check_mib']:.0f} MiB: {row['ratio']:.2f}x of bare")
    L.append("(h) test suite, pytest -n auto: " + ("not run (--no-suite or --quick)" if r["suite_s"] is None
                                                  else f"{r['suite_s']:.0f}s"))
    L.append(format_profile(r["profile"]))
    return "\n".join(L)
