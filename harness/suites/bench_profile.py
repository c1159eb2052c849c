"""Stage: suites. Where a verified example's time goes (issue 14: "the profile that shows where
the time goes"), per rank, from one instrumented check beside one bare job on the same pool.

`profile_rank` is `sp_harness.checks.side_by_side_rank.run_rank` with wall-clock timers around its
stages: the sharded forward/backward, each reference pass on the rank that owns it, the
broadcasts that share them (a non-owner's broadcast time is mostly waiting for the owner), the
comparisons and the optimizer stage. The perturbed reference (`alt`) is split further by wrapping
its RoundingNoise: the input/output noise (`_noisy`: pool windows and the multiply), the
order error of every matmul (`order_error`: its magnitude matmuls and noise), the softmax-backward
rowsum error; its base float64 compute is timed as a plain pass of the same model on the same
batches (a copy, after the check), and Python dispatch is what is left. The timers
cost a few microseconds per op; the numbers are one run's, on a machine whose load skews them.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sp_harness.config.check_config import CheckConfig

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner

STAGES = ("setup", "sharded", "r64", "lp", "alt", "anchor", "broadcast", "gather", "compare", "optimizer")
"""Per-rank stages, in the order the table prints them; everything else is `other`."""
ALT_PARTS = ("alt_base", "alt_noise", "alt_order_error", "alt_rowsum", "alt_dispatch")


@dataclass(kw_only=True, frozen=True)
class RankProfile:
    rank: int
    total_s: float
    seconds: dict[str, float]
    """Stage -> wall seconds on this rank (STAGES, `other`, and ALT_PARTS on the alt owner)."""
    total_cpu_s: float
    cpu_seconds: dict[str, float]
    """The same in this process's CPU seconds: what the stage costs on a loaded machine, where
    wall time also counts the waits for a core (and a broadcast's waits for its owner)."""
    num_noised_ops: int
    """Calls of RoundingNoise._noisy on this rank (tensor inputs and results perturbed)."""
    num_noised_elements: int


@dataclass
class _Clock:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    num_noised_ops: int = 0
    num_noised_elements: int = 0

    def wrap(self, key: str, fn):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0
                self.cpu_seconds[key] += time.process_time() - c0
        return timed


def _time_method(clock: _Clock, key: str, obj: object, name: str) -> None:
    """`obj.name`, timed under `key` from now on (an instance attribute over its method)."""
    setattr(obj, name, clock.wrap(key, getattr(obj, name)))


def _instrument_alt(clock: _Clock, refs) -> list:
    """Time the perturbed reference's parts. Returns the list its batches are appended to: its
    base compute is timed after the check (`_time_alt_base`), so that the other ranks do not
    wait for a pass the check does not make."""
    import sp_harness.step.rounding as rounding

    noise = refs.alt_noise
    for name in ("_noisy", "_noisy_in_place"):
        method = getattr(noise, name)

        def counted(t, method=method):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                clock.num_noised_ops += 1
                clock.num_noised_elements += t.numel()
            return method(t)

        setattr(noise, name, clock.wrap("alt_noise", counted))
    noise._rowsum_error = clock.wrap("alt_rowsum", noise._rowsum_error)
    rounding.order_error = clock.wrap("alt_order_error", rounding.order_error)
    compute, batches = refs.compute, []

    def compute_timed(which, full, case, batch, pieces=()):
        if which == "alt":
            batches.append((case, batch))
        return clock.wrap(which, compute)(which, full, case, batch, pieces)

    refs.compute = compute_timed
    return batches


def _time_alt_base(clock: _Clock, refs, batches: list) -> None:
    """The perturbed reference's passes again, plain float64 on a copy: its base compute."""
    from sp_harness.step.reference import reference_pass

    for case, batch in batches:
        plain = copy.deepcopy(refs.alt)
        clock.wrap("alt_base", reference_pass)(plain, case, batch, torch.float64)


def profile_rank(config: CheckConfig) -> RankProfile:
    """Rank job: one check, as run_rank runs it, with its stages timed."""
    import sp_harness.checks.references as references
    import sp_harness.checks.side_by_side_rank as rank_job
    import sp_harness.step.rounding as rounding
    from sp_harness.step.inputs import batch_generator

    clock = _Clock()
    saved = (references._share, rank_job.gather_full, rounding.order_error)
    references._share = clock.wrap("broadcast", references._share)
    rank_job.gather_full = clock.wrap("gather", rank_job.gather_full)
    try:
        t_start, c_start = time.perf_counter(), time.process_time()
        run = rank_job._SideBySide(config, inline_references=True)
        clock.seconds["setup"] = time.perf_counter() - t_start
        clock.cpu_seconds["setup"] = time.process_time() - c_start
        assert run.inline is not None, "inline_references=True: this rank holds the references"
        alt_batches = _instrument_alt(clock, run.inline)
        _time_method(clock, "anchor", run.inline, "anchor")
        _time_method(clock, "sharded", run, "sharded_pass")
        _time_method(clock, "compare", run, "judge_outputs")
        _time_method(clock, "compare", run, "judge_grads")
        _time_method(clock, "optimizer", run, "optimizer_stage")
        run.check_init()
        gen = batch_generator(config.seed)
        assert config.steps is not None, "run_profile resolves steps"
        for step in range(config.steps):
            run.step(step, gen)
        run.recorder.remove()
        total, total_cpu = time.perf_counter() - t_start, time.process_time() - c_start
        _time_alt_base(clock, run.inline, alt_batches)
    finally:
        references._share, rank_job.gather_full, rounding.order_error = saved
    return RankProfile(rank=run.ctx.rank, total_s=total, seconds=_breakdown(clock.seconds, total), total_cpu_s=total_cpu,
                       cpu_seconds=_breakdown(clock.cpu_seconds, total_cpu), num_noised_ops=clock.num_noised_ops,
                       num_noised_elements=clock.num_noised_elements)


def _breakdown(timed: dict[str, float], total: float) -> dict[str, float]:
    """The stages, `other` (the rest of the total) and the perturbed reference's parts."""
    seconds = dict(timed)
    alt_base = seconds.pop("alt_base", 0.0)
    seconds["other"] = total - sum(seconds.get(k, 0.0) for k in STAGES)
    if "alt" in seconds:
        parts = sum(seconds.get(k, 0.0) for k in ALT_PARTS[1:4])
        seconds.update(alt_base=alt_base, alt_dispatch=seconds["alt"] - alt_base - parts)
    return seconds


def run_profile(config: CheckConfig, runner: Runner) -> dict:
    """One untimed warm-up check, then one profiled check and one bare job, same pool."""
    from sp_harness.checks.side_by_side import check, resolve
    from sp_harness.suites.bench_bare import bare_rank

    config = resolve(config)
    assert config.timeout_s is not None, "resolve fills timeout_s"
    check(config, runner)
    t0 = time.perf_counter()
    ranks = runner.run(config.world_size, profile_rank, config,
                       timeout_s=config.timeout_s, label=f"bench profile {config.case}", case=config.case)
    profiled_s = time.perf_counter() - t0
    bare = runner.run(config.world_size, bare_rank, config, timeout_s=config.timeout_s,
                      label=f"bench bare {config.case}", case=config.case)
    return {"case": config.case, "world_size": config.world_size, "hidden": config.hidden, "seq_len": config.seq_len,
            "num_layers": config.num_layers, "dtype": str(config.dtype), "steps": config.steps,
            "profiled_s": profiled_s, "bare_rank_s": [b["total_s"] for b in bare],
            "bare_rank_cpu_s": [b["cpu_s"] for b in bare],
            "ranks": [_asdict(r) for r in ranks]}


def _asdict(r: RankProfile) -> dict:
    return {"rank": r.rank, "total_s": r.total_s, "seconds": dict(r.seconds), "total_cpu_s": r.total_cpu_s,
            "cpu_seconds": dict(r.cpu_seconds), "num_noised_ops": r.num_noised_ops,
            "num_noised_elements": r.num_noised_elements}


_LABELS = {
    "setup": "build models + references", "sharded": "sharded fwd/bwd/grad sync", "r64": "reference r64 (float64)",
    "lp": "reference lp (run dtype + order noise)", "alt": "reference alt (perturbed float64)",
    "alt_base": "  alt: base float64 compute", "alt_noise": "  alt: input/output noise",
    "alt_order_error": "  alt: order_error (magnitude matmuls)", "alt_rowsum": "  alt: softmax rowsum error",
    "alt_dispatch": "  alt: Python dispatch + rest", "anchor": "load sharded params into refs", "broadcast": "broadcast refs (incl. waiting)",
    "gather": "gather sharded params", "compare": "compare outputs/grads", "optimizer": "optimizer + param checks",
    "other": "other (init checks, batches)",
}


def format_profile(p: dict) -> str:
    ranks = p["ranks"]
    head = (f"(i) where the time goes: {p['case']} ws={p['world_size']} hidden {p['hidden']} seq {p['seq_len']} "
            f"{p['num_layers']} layers {p['dtype']} {p['steps']} steps, one profiled check "
            f"({p['profiled_s']:.2f}s wall through the pool; bare_rank " + "/".join(f"{s:.2f}" for s in p["bare_rank_s"])
            + "s); per rank: CPU seconds (immune to other jobs' load), share, wall seconds")
    check_cpu, bare_cpu = max(r["total_cpu_s"] for r in ranks), max(p["bare_rank_cpu_s"])
    L = [head, f"  {'stage':<40}" + "".join(f" {'rank ' + str(r['rank']) + ' cpu s':>15} {'wall s':>7}" for r in ranks)]
    for key in (*STAGES[:5], *ALT_PARTS, *STAGES[5:], "other"):
        if not any(key in r["seconds"] for r in ranks):
            continue
        cells = []
        for r in ranks:
            cpu, wall = r["cpu_seconds"].get(key), r["seconds"].get(key)
            cells.append(f" {'-':>15} {'':>7}" if cpu is None else
                         f" {cpu:>9.3f} {100 * cpu / r['total_cpu_s']:>4.0f}% {wall:>7.3f}")
        L.append(f"  {_LABELS[key]:<40}" + "".join(cells))
    L.append(f"  {'total':<40}" + "".join(f" {r['total_cpu_s']:>9.3f}       {r['total_s']:>7.3f}" for r in ranks))
    L.append(f"  busiest rank's CPU seconds, check {check_cpu:.3f} / bare_rank {bare_cpu:.3f} = "
             f"{check_cpu / bare_cpu:.2f}x (the load-free counterpart of the check / bare ratio)")
    for r in ranks:
        if "alt" in r["cpu_seconds"]:
            L.append(f"  alt on rank {r['rank']}: {r['num_noised_ops']} tensors noised, "
                     f"{r['num_noised_elements'] / 1e6:.1f}M elements; alt / its base float64 pass (CPU): "
                     f"{r['cpu_seconds']['alt'] / max(1e-9, r['cpu_seconds']['alt_base']):.2f}x")
    return "\n".join(L)
