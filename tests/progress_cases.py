"""User-style case file for the pool's hang rules (sp_harness.launch.activity.Liveness): correct
checks that are slow, and ranks that stop or spin while stepping.

Loaded as `tests/progress_cases.py:NAME`. Each is seed-mlp run whole on every rank (nothing
sharded, so each PASSes unless it hangs), with a forward pre-hook that makes one step slow or
stuck; the hook runs in the steps phase, so a hang here is the code under test's.
"""

# These cases change no process-wide state: they share the built-in cases' rank processes
# (Case.isolation), which keeps the suite from starting a pool per case.

import time

import torch
import torch.distributed as dist

from sp_harness.cases.dtensor_plans import SEED_MLP
from sp_harness.config.case import Case, Layout, Sharded


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _with_hook(hook):
    def shard(model, ctx):
        calls = [0]

        def pre_hook(module, args):
            calls[0] += 1
            hook(ctx.rank, calls[0])

        model.register_forward_pre_hook(pre_hook)
        return Sharded(module=model, input_layout=Layout(seq_dim=0, seq_sharded=False),
                       output_layout=Layout(seq_dim=0, seq_sharded=False), replicated=("*",))
    return shard


BURN_S = 3.0
"""Per forward, rank 1's silent computation: three of the no-progress windows the test sets."""


def _burning(rank: int, call: int) -> None:
    # rank 1 computes without a word while rank 0 waits, asleep, in the step's next collective:
    # the one sign of life is rank 1's CPU, as in a realistic size's long matmul
    if rank == 1:
        _burn(BURN_S)


CHUNKS, CHUNK_S = 6, 4.5
"""Per forward, the work of a slow correct step: 6 pieces of 4.5 s (27 s a step, 81 s for the
three steps, 2.7 times the old flat 30 s timeout), each followed by a collective, as a large
model's layers are; a piece is a sleep, so the test costs the machine no CPU."""


def _slow(rank: int, call: int) -> None:
    for _ in range(CHUNKS):
        time.sleep(CHUNK_S)
        dist.all_reduce(torch.zeros(1))


def _asleep(rank: int, call: int) -> None:
    if rank == 1:
        time.sleep(3600)


def _spinning(rank: int, call: int) -> None:
    # from its second step on, rank 1 never finishes computing: the no-progress rule cannot see
    # it (its CPU advances), only the cap its first step set can
    if rank == 1 and call > 1:
        while True:
            pass


def _variant(name, hook):
    return Case(isolation="shared", name=name, description=name, build_reference=SEED_MLP.build_reference,
                make_batch=SEED_MLP.make_batch, loss_sum=SEED_MLP.loss_sum, tokens=SEED_MLP.tokens,
                shard=_with_hook(hook), defaults=SEED_MLP.defaults, input_layout=SEED_MLP.input_layout)


BURNING = _variant("burning", _burning)
SLOW = _variant("slow", _slow)
ASLEEP = _variant("asleep", _asleep)
SPINNING = _variant("spinning", _spinning)
