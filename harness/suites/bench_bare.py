"""Stage: suites. The compute a check wraps, bare (`bare_rank`, a rank job) and its timing: what
`sp-harness bench` (sp_harness.suites.bench, bench_realistic, bench_profile) sets a verified
example's cost against.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sp_harness.config.check_config import CheckConfig

if TYPE_CHECKING:
    from sp_harness.launch.runner import Runner


def bare_rank(config: CheckConfig) -> dict:
    """The compute a check wraps, bare: the float64 reference and the case's sharded model built
    as `sp_harness.checks.side_by_side_rank.run_rank` builds them, then `config.steps` steps of
    forward, loss, backward, grad sync and optimizer step on both. No extra reference copies, no
    capture, no comparison, no replica-drift collectives.

    The reference takes all its steps before the sharded model is built: a sharded factory may
    replace a global that the reference would then call (DeepSpeed's UlyssesSPAttentionHF
    registers itself in transformers' attention table), and a check runs its references in
    processes of their own. The same compute, in another order."""
    from sp_harness.config.case import as_batch, get_case
    from sp_harness.step.build import build, cast_floating, new_reference
    from sp_harness.step.context import rank_device, reference_context
    from sp_harness.step.inputs import batch_generator
    from sp_harness.step.loop import ShardedLoop
    from sp_harness.step.optim_ref import make_optimizer
    from sp_harness.step.reference import reference_pass

    t_start, c_start = time.perf_counter(), time.process_time()
    case = get_case(config.case)
    config = case.resolve(config)
    assert config.optimizer is not None and config.lr is not None and config.steps is not None, \
        "resolve fills optimizer, lr and steps"
    device = rank_device()
    ref = cast_floating(new_reference(case, config, reference_context(config, device)).to(device=device), torch.float64)
    opt_ref = make_optimizer(config.optimizer, config.lr, ref.parameters())
    gen = batch_generator(config.seed)
    batches = [as_batch(case.make_batch(config, step, gen)) for step in range(config.steps)]
    t_setup = time.perf_counter() - t_start
    for batch in batches:
        reference_pass(ref, case, batch, torch.float64)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
    t_built = time.perf_counter()
    loop = ShardedLoop(build(config))
    t_setup += time.perf_counter() - t_built
    for batch in batches:
        loop.step(batch)
    return {"setup_s": t_setup, "total_s": time.perf_counter() - t_start, "cpu_s": time.process_time() - c_start}


def timed_bare(config: CheckConfig, runner: Runner, reps: int) -> list[float]:
    """Wall seconds of `reps` bare runs of `config` (resolved as a check resolves it)."""
    from sp_harness.checks.side_by_side import resolve

    config = resolve(config)
    assert config.timeout_s is not None, "resolve fills timeout_s"
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        # case=: the case's own processes and its setup, as its check gets them (a framework case
        # built in the shared pool, without its setup, raised inside the framework)
        runner.run(config.world_size, bare_rank, config, timeout_s=config.timeout_s,
                   label=f"bench bare {config.case} [{config.short()}]", case=config.case)
        times.append(time.perf_counter() - t0)
    return times
