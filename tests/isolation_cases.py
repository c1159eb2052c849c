"""User-style cases for the isolation tests: a mutant that monkeypatches a library function in its
rank processes (as any mutant of third-party code must), its correct twin, cases with a
per-process setup, and a rank that leaves a child process behind.

Loaded as `tests/isolation_cases.py:NAME`; paths for the setup and child logs come from the
environment the ranks inherit."""

import os
import subprocess
import time

import torch
import torch.nn.functional as F
from torch import nn

from sp_harness import Case, Layout, Sharded, mutant

WIDTH = 8
_GELU = F.gelu


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):  # (S, W) -> (S, W); F.gelu looked up at call time, as library code does
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _reference(cfg):
    torch.manual_seed(cfg.seed)
    return GeluMLP().double()


def _batch(cfg, step, gen):
    return (torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64))


def _replicated(model, ctx):
    return Sharded(module=model, input_layout=Layout(seq_dim=0, seq_sharded=False),
                   output_layout=Layout(seq_dim=0, seq_sharded=False), replicated=("*",))


def _patching(model, ctx):
    torch.nn.functional.gelu = lambda x, approximate="none": _GELU(x, approximate=approximate) * 1.01
    return _replicated(model, ctx)


TWIN = Case(name="gelu-mlp", description="a replicated GELU MLP", build_reference=_reference, make_batch=_batch,
            shard=_replicated, loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(), tokens=lambda t: t.shape[0],
            defaults=dict(seq_len=6))
PATCHING = mutant(TWIN, name="mutant-gelu-patched", summary="monkeypatches torch.nn.functional.gelu in its ranks",
                  bug="a library function patched by the code under test (a fused-kernel shim that scales)",
                  source="tests/isolation_cases.py (engine test)", shard=_patching)
# the same two, declared to share processes: what a warm pool did to every case before
TWIN_SHARED = mutant(TWIN, name="mutant-gelu-twin-shared", summary="the twin, sharing processes",
                     bug="none (the correct twin)", source="tests/isolation_cases.py", isolation="shared")
PATCHING_SHARED = mutant(PATCHING, name="mutant-gelu-patched-shared", summary="the patcher, sharing processes",
                         bug=PATCHING.models_bug, source=PATCHING.source, isolation="shared")


def _slow_setup():
    time.sleep(float(os.environ.get("SP_TEST_SETUP_S", "0")))
    with open(os.environ["SP_TEST_SETUP_LOG"], "a") as f:
        f.write(f"{os.getpid()}\n")


def _failing_setup():
    raise RuntimeError("the op did not compile (on purpose)")


WITH_SETUP = mutant(TWIN, name="mutant-gelu-with-setup", summary="a slow per-process setup",
                    bug="none (a correct case with a setup)", source="tests/isolation_cases.py", setup=_slow_setup)
SETUP_FAILS = mutant(TWIN, name="mutant-gelu-setup-fails", summary="a setup that raises",
                     bug="none (a correct case whose setup fails)", source="tests/isolation_cases.py",
                     setup=_failing_setup)


def _leaves_a_child(model, ctx):
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["SP_TEST_CHILD_LOG"], "a") as f:
        f.write(f"{child.pid}\n")
    if ctx.rank == 1:
        time.sleep(3600)
    return _replicated(model, ctx)


LEAVES_A_CHILD = mutant(TWIN, name="mutant-gelu-leaves-child", summary="a rank starts a child, then hangs",
                        bug="a hang in a rank that started a helper process (a compiler)",
                        source="tests/isolation_cases.py", shard=_leaves_a_child)
