"""Precision islands (issue 19): ops a correct implementation computes below the run's dtype on
purpose are modelled at their real precision by the perturbed reference and named in the result,
while a real bug in or around an island still FAILs. Case file: tests/island_cases.py."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from sp_harness.capture.islands import Island, IslandObserver, summary
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.report.result_text import format_result
from sp_harness.step.noise_pool import NoisePool
from sp_harness.step.rounding import RoundingNoise

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "island_cases.py")
EPS64, EPS32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps


def _noise(seed=3):
    return RoundingNoise(EPS64, torch.Generator().manual_seed(seed))


def _rel_err(got, want):
    return float(((got.double() - want.double()).abs() / want.double().abs()).max())


# -- the rounding model, no process group -------------------------------------------------------

def test_a_float32_op_in_a_float64_pass_gets_float32_noise():
    x = torch.rand(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    with _noise():
        island = x.float() * 3.0  # a cast down and an op in float32
        plain = x * 3.0
        product = x.float() @ x.float().T  # an island's matmul: float32's accumulator
    assert island.dtype == torch.float32
    # at least one float32 rounding of noise on every element, a few at most
    assert EPS32 / 4 < _rel_err(island, x.float() * 3.0) < 8 * EPS32
    assert _rel_err(plain, x * 3.0) < 4 * EPS64
    assert _rel_err(product, x.float() @ x.float().T) > 1e3 * EPS64


def test_a_pure_float64_pass_draws_what_it_always_drew():
    # the model as it was before islands: inputs and the fresh result, each times a window of
    # (1 + eps64 u), drawn in that order from the pool
    x, y = (torch.rand(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    noise, model = _noise(seed=11), nn.Linear(2, 2)
    with noise, noise.islands(model, {}):
        got = x + y
    pool = NoisePool(torch.Generator().manual_seed(11))
    fx, fy, fz = (pool.factor_window(x.shape, torch.float64, x.device, EPS64) for _ in range(3))
    want = (x * fx + y * fy) * fz
    assert torch.equal(got, want)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8).double(), nn.Linear(8, 8).double()

    def forward(self, x):
        return self.outer(self.inner(x))


def test_a_declared_island_rounds_its_modules_ops_at_its_dtype():
    torch.manual_seed(0)
    net, x = _Net(), torch.rand(4, 8, dtype=torch.float64, requires_grad=True)
    exact_inner = net.inner(x).detach()
    seen = {}
    net.inner.register_forward_hook(lambda m, a, out: seen.__setitem__("inner", out.detach()))
    noise = _noise()
    with noise, noise.islands(net, {"inner": "float32"}):
        net(x).sum().backward()
    assert _rel_err(seen["inner"], exact_inner) > 1e3 * EPS64  # float32-sized, in float64 tensors
    with noise, noise.islands(net, {"outer": "float32"}):
        net(x)
    assert _rel_err(seen["inner"], exact_inner) < 1e3 * EPS64  # outside the island: float64's


def test_island_dtype_names_are_validated():
    fields = dict(name="bad", description="", build_reference=None, make_batch=None, loss_sum=None,
                  tokens=None, shard=None)
    with pytest.raises(ValueError, match="'fp32' is not a dtype an island can compute in; valid: float32"):
        Case(**fields, precision_islands={"head": "fp32"})
    Case(**fields, precision_islands={"head": "bfloat16"})


# -- the observer, no process group -------------------------------------------------------------

class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x):
        return F.log_softmax(self.proj(x).float(), -1)  # the island's line


def test_the_observer_names_module_op_dtype_and_line():
    model = nn.Sequential(nn.Linear(4, 4), _Head()).double()
    x = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    with IslandObserver(model, torch.float64) as observer:
        model(x).sum().backward()
    line = f"test_islands.py:{_Head.forward.__code__.co_firstlineno + 1}"
    found = observer.islands
    assert Island(module="1", op="aten._log_softmax", dtype="float32", where=line) in found
    assert Island(module="1", op="aten._to_copy", dtype="float32", where=line) in found
    assert Island(module="1", op="aten._log_softmax_backward_data", dtype="float32", where="backward") in found
    assert {i.module for i in found} == {"1", "loss"}  # the .sum() above is outside the model
    with IslandObserver(model, torch.float32) as observer:  # float32 is no island in a float32 run
        model(x).sum().backward()
    assert observer.islands == []


class _Flex(nn.Module):
    def forward(self, q, k, v):
        return flex_attention(q.float(), k.float(), v.float())  # the island's line


def test_flex_attention_runs_under_the_observer_on_cpu():
    # torch's flex_attention is a higher-order op that eager mode runs through torch.compile: a
    # mode without a rule for HOPs made it raise NotImplementedError, so a FlexAttention model
    # (torchtitan's) could not be checked. CPU flex_attention has no backward: forward only
    import warnings
    q, k, v = (torch.rand(1, 2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    model = _Flex()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile()"
        want = model(q, k, v)
        with IslandObserver(model, torch.float64) as observer:
            got = model(q, k, v)
    assert torch.equal(got, want)
    line = f"test_islands.py:{_Flex.forward.__code__.co_firstlineno + 1}"
    assert Island(module="_Flex", op="hop.flex_attention", dtype="float32", where=line) in observer.islands


def test_the_summary_caps_its_list():
    islands = [Island(module=f"blocks.{i}.rope", op="aten.mul", dtype="float32", where=f"m.py:{i}") for i in range(11)]
    line = summary(islands, "float64")
    assert line.startswith("precision islands: 11 ops computed below float64: blocks.0.rope (aten.mul float32, m.py:0)")
    assert line.endswith("... and 3 more") and "blocks.7.rope" in line and "blocks.8.rope" not in line


# -- real gloo ranks ----------------------------------------------------------------------------

def test_a_correct_case_with_float32_islands_passes_at_float64_and_names_them(sp_check):
    res = sp_check(CheckConfig(case=f"{CASES}:ISLAND_LM", world_size=2, dtype="float64"))
    assert res.verdict == "PASS", res.reason
    ops = {(i.module, i.op) for i in res.islands}
    assert {("loss", "aten._log_softmax"), ("context", "aten.sum"), ("norm", "aten.rsqrt")} <= ops
    text = format_result(res)
    assert "precision islands: " in text and "loss (aten._to_copy, aten._log_softmax" in text
    assert res.to_json()["islands"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_correct_case_passes_at_lower_precisions(sp_check, dtype):
    res = sp_check(CheckConfig(case=f"{CASES}:ISLAND_LM", world_size=2, dtype=dtype))
    assert res.verdict == "PASS", res.reason
    assert res.islands == []  # float32 is no island there


def test_a_bug_inside_an_island_fails_and_the_result_names_the_island(sp_check):
    res = sp_check(CheckConfig(case=f"{CASES}:ISLAND_LM_SCALED", world_size=2, dtype="float64"))
    assert res.verdict == "FAIL" and not res.error, res.reason
    assert res.failures[0].ratio > 10
    assert ("context", "aten.sum") in {(i.module, i.op) for i in res.islands}
    rows = format_result(res).splitlines()
    first = next(i for i, r in enumerate(rows) if r.startswith("FAIL: first failure"))
    assert rows[first + 1].startswith("candidate cause, precision islands: ")


def test_a_fused_float32_kernel_needs_declaring(sp_check):
    # the same kernel, invisible to dispatch: undeclared, its float32 rounding reads as a bug
    res = sp_check(CheckConfig(case=f"{CASES}:FUSED_UNDECLARED", world_size=2, dtype="float64"))
    assert res.verdict == "FAIL" and res.islands == [], res.reason
    res = sp_check(CheckConfig(case=f"{CASES}:FUSED", world_size=2, dtype="float64"))
    assert res.verdict == "PASS", res.reason
    assert res.islands == [Island(module="context", op="declared", dtype="float32", where="declared")]
    assert "1 declared by the case: context (declared float32)" in format_result(res)


def test_a_bug_after_a_declared_island_still_fails(sp_check):
    res = sp_check(CheckConfig(case=f"{CASES}:FUSED_SCALED", world_size=2, dtype="float64"))
    assert res.verdict == "FAIL" and not res.error and res.failures[0].ratio > 10, res.reason
    assert "candidate cause, precision islands: 1 declared by the case" in format_result(res)
