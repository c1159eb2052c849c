"""The engine against third-party habits: process-wide registrations by the sharded factory
never reach the references, buffers keep their dtype through the run-dtype cast, models that
hold process groups are built from the factory (never deep-copied), a factory may take the rank
context. Real gloo ranks."""

import os

import pytest
import torch

from sp_harness import CheckConfig
from sp_harness.step.build import cast_floating

HERE = os.path.dirname(__file__)
CASES = os.path.join(HERE, "third_party_cases.py")


def _case(name: str) -> str:
    return f"{CASES}:{name}"


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.exhaustive("the fast tier runs 2 ranks"))])
def test_a_global_registration_by_the_sharded_factory_does_not_reach_the_references(sp_check, world_size):
    """A reference that ran the registered attention is wrong, and the references disagree with
    each other (the owner of the float64 one registered another offset than the perturbed one's):
    the bound they make is then the size of the output (the old engine PASSed this case with a
    forward bound of 16 x 0.3), so the check asserts a float64-sized bound, not just a PASS."""
    result = sp_check(CheckConfig(case=_case("REGISTERING"), world_size=world_size, dtype="float64"))
    assert result.verdict == "PASS", result.reason
    assert result.worst["forward"].allowed < 1e-10, result.worst["forward"].describe()


def test_a_wrong_registration_fails(sp_check):
    result = sp_check(CheckConfig(case=_case("REGISTERING_WRONG_OFFSET"), world_size=2, dtype="float64"))
    assert result.verdict == "FAIL" and result.failures[0].kind == "forward", result.reason


def test_the_registration_would_change_a_reference_computed_beside_it():
    """Why the test above can fail: in the process where the sharded factory ran, the reference's
    own forward goes through the registered attention and computes something else."""
    from sp_harness.config.loading import load_case_file

    mod = load_case_file(CASES)
    model = mod.Attention().double()
    x = torch.randn(8, mod.WIDTH, dtype=torch.float64)
    before = model(x)
    saved = dict(mod.ATTENTION)
    try:
        mod.register_sp_attention(4)
        assert not torch.allclose(model(x), before)
    finally:
        mod.ATTENTION.update(saved)


def test_cast_touches_floating_tensors_only():
    m = torch.nn.Module()
    m.register_buffer("cache", torch.polar(torch.ones(3), torch.tensor([0.1, 0.2, 0.3])))
    m.register_buffer("index", torch.arange(3))
    m.weight = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    imag = m.cache.imag.clone()
    cast_floating(m, torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    assert m.cache.dtype == torch.complex64 and torch.equal(m.cache.imag, imag)
    assert m.index.dtype == torch.int64


@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.exhaustive(
    "the fast tier runs float32, whose check casts the reference to float64 as this one does (its r64) and "
    "its copies to float32 besides")), "float32"])
def test_a_complex_rope_cache_survives_the_cast(sp_check, dtype):
    """The sharded side makes its own complex cache; a cast that dropped the reference's imaginary
    part made this correct model FAIL."""
    result = sp_check(CheckConfig(case=_case("COMPLEX_ROPE"), world_size=2, dtype=dtype))
    assert result.verdict == "PASS", result.reason


def test_a_model_holding_its_process_group_is_built_from_the_factory(sp_check):
    result = sp_check(CheckConfig(case=_case("HOLDS_GROUP"), world_size=2))
    assert result.verdict == "PASS", result.reason


def test_an_lse_under_a_name_the_reference_lacks_is_reported_not_run(sp_check):
    result = sp_check(CheckConfig(case=_case("RENAMED_RING"), world_size=2, steps=1))
    assert result.verdict == "PASS", result.reason
    assert "lse" not in result.worst
    assert any("'blocks.0.attn.sp_attn'" in why and "blocks.0.attn" in why for why in result.not_run), result.not_run
