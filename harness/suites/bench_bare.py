"""Stage: suites. The compute a check wraps, bare (`bare_rank`, a rank job) and its timing: what
`sp-harness bench` (sp_harness.suites.bench, bench_realistic, bench_profile) sets a verified
example's cost against.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sp_harness.config.check_config import CheckConfig

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner


def bare_rank(config: CheckConfig) -> dict:
    """The compute a check wraps, bare: the float64 reference and the case's sharded model built
    as `sp_harness.checks.side_by_side_rank.run_rank` builds them, then `config.steps` steps of
    forward, loss, backward, grad sync and optimizer step on both. No extra reference copies, no
    capture, no comparison, no replica-drift collectives.

    The reference computes where a check's does, in the rank's reference process
    (sp_harness.checks.refproc), overlapping the sharded step: a sharded factory may replace a
    global the reference would otherwise call (DeepSpeed's UlyssesSPAttentionHF registers itself
    in transformers' attention table, and it stays there for the rank's next job)."""
    from sp_harness.checks.refproc import Remote
    from sp_harness.config.case import as_batch
    from sp_harness.step.build import build
    from sp_harness.step.inputs import batch_generator
    from sp_harness.step.loop import ShardedLoop
    from sp_harness.step.optim_ref import make_optimizer

    t_start, c_start = time.perf_counter(), time.process_time()
    built = build(config)
    config, case, ref = built.config, built.case, built.reference
    assert config.optimizer is not None and config.lr is not None and config.steps is not None, \
        "build resolves optimizer, lr and steps"
    opt_ref = make_optimizer(config.optimizer, config.lr, ref.parameters())
    remote = Remote(config, ref, built.device)
    loop = ShardedLoop(built)
    gen = batch_generator(config.seed)
    t_setup = time.perf_counter() - t_start
    for step in range(config.steps):
        batch = as_batch(case.make_batch(config, step, gen))
        remote.start(("r64",), {n: p.detach() for n, p in ref.named_parameters()}, batch, ())
        loop.step(batch)
        grads = remote.finish()["r64"].grads
        for name, p in ref.named_parameters():
            p.grad = grads[name]
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
    return {"setup_s": t_setup, "total_s": time.perf_counter() - t_start, "cpu_s": time.process_time() - c_start}


def timed_bare(config: CheckConfig, runner: Runner, reps: int) -> list[float]:
    """Wall seconds of `reps` bare runs of `config` (resolved as a check resolves it)."""
    from sp_harness.checks.side_by_side import resolve

    config = resolve(config)
    assert config.timeout_s is not None, "resolve fills timeout_s"
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        # case=: the processes and setup its check gets (a framework case's own group, its import)
        runner.run(config.world_size, bare_rank, config, timeout_s=config.timeout_s,
                   label=f"bench bare {config.case} [{config.short()}]", case=config.case)
        times.append(time.perf_counter() - t0)
    return times
