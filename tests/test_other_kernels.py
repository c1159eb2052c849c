"""Verdicts do not depend on the CPU's kernel family (issue 10, item 8).

The suite's own pool runs torch's native kernels (AVX-512 on some CI machines, AVX2 on others).
Here a second pool runs the correct cases and a few mutants with another family forced through
ATEN_CPU_CAPABILITY, and under the reorder adversary, so a tolerance that fits only one family
fails CI on any machine."""

import pytest
import torch

from sp_harness.checks.side_by_side import check
from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import FAIL, PASS
from sp_harness.launch.manager import PoolManager
from sp_harness.launch.wire import PoolOptions

NATIVE = torch.backends.cpu.get_cpu_capability().lower()
# the fast tier runs `default` (no SIMD: the family furthest from any native one); on an AVX-512
# machine the full tier adds avx2
FAMILIES = [c if c == "default" else pytest.param(c, marks=pytest.mark.exhaustive("the fast tier runs `default`"))
            for c in ("default", "avx2") if c != NATIVE]

CORRECT = [
    CheckConfig(case="megatron-gpt-sp", world_size=2),
    CheckConfig(case="megatron-gpt-sp", world_size=3, seq_len=10, dtype="float32", adversary="reorder"),
    CheckConfig(case="megatron-gpt-sp", world_size=2, dtype="bfloat16", adversary="reorder"),
    CheckConfig(case="megatron-gpt-tp", world_size=2),
    CheckConfig(case="megatron-gpt-tp", world_size=2, dtype="float32", adversary="reorder-tf32"),
    CheckConfig(case="megatron-gpt-ref", world_size=2, dp=2),
    CheckConfig(case="dtensor-gpt", world_size=2),
    CheckConfig(case="seed-mlp", world_size=2, dtype="float32"),
]
BROKEN = ["mutant-sp-no-norm-grad-sync", "mutant-sp-local-positions", "mutant-tp-row-bias-before-reduce"]


@pytest.fixture(scope="module", params=FAMILIES)
def other_pool(request):
    manager = PoolManager(PoolOptions(env=(("ATEN_CPU_CAPABILITY", request.param),)), max_pools=2)
    yield manager
    manager.close()


def _probe_capability(_payload):
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def test_the_pool_really_runs_the_other_family(other_pool, request):
    family = request.node.callspec.params["other_pool"]
    got = other_pool.run(1, _probe_capability, None, timeout_s=120, label="probe")
    assert got == [family]


@pytest.mark.parametrize("config", CORRECT, ids=lambda c: f"{c.case}-ws{c.world_size}-{c.dtype}-{c.adversary}")
def test_correct_cases_pass_on_another_kernel_family(other_pool, config):
    res = check(config.replace(timeout_s=300.0), other_pool)
    assert res.verdict == PASS, res.reason


@pytest.mark.parametrize("mutant", BROKEN)
def test_mutants_still_fail_on_another_kernel_family(other_pool, mutant):
    assert check(CheckConfig(case=mutant, world_size=2, timeout_s=300.0), other_pool).verdict == FAIL
