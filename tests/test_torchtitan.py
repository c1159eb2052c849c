"""torchtitan 0.3.0 as a system under test (sp_harness.cases.frameworks.torchtitan), on real gloo
ranks: its llama3 under its own TP + SP sharding config (`Module.parallelize`, DTensor backend)
at TP 2 and 4, and DP 2 x TP 2 under its own FSDP2, against the same model unsharded, and a plan bug expressed through torchtitan's
own `ShardingConfig`, which must FAIL at the forward."""

import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("torchtitan", "torchtitan is not installed (pip install -e '.[torchtitan]')")

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402

EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "torchtitan_case.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; torchtitan's import is the case's setup, outside it."""


def _config(name: str, **fields) -> CheckConfig:
    return CheckConfig(case=f"{EXAMPLE}:{name}", timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("name,world_size,dp,dtype", [
    ("LLAMA3_SP_TP2", 2, 1, "float32"),
    pytest.param("LLAMA3_SP_TP4", 4, 1, "float32", marks=pytest.mark.exhaustive(
        "the fast tier runs TP 2, and 4 ranks as DP 2 x TP 2")),
    ("LLAMA3_SP_TP2", 2, 1, "bfloat16"),
    ("LLAMA3_SP_TP2", 4, 2, "float32"),  # DP 2 x TP 2: torchtitan's own FSDP2 (apply_fsdp_to_decoder)
])
def test_llama3_sequence_parallel_passes(sp_check, name, world_size, dp, dtype):
    res = sp_check(_config(name, world_size=world_size, dp=dp, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)
    assert not res.drift


def test_float64_passes_with_ropes_float32_island_on_both_sides(sp_check):
    # torchtitan's ComplexRoPE rotates in float32 (`query.float()`, the cache is complex64) and
    # casts back: an island the reference has too, so float64 agrees to ~1e-15 unperturbed; under
    # the reorder adversary a reordered float64 sum can round to the other float32 neighbour in
    # the rope, so the forward differs by up to ~1e-11 relative (measured 1.7e-11), within the bound
    res = sp_check(_config("LLAMA3_GQA_SP_TP2", world_size=2, dtype="float64", adversary="reorder"))
    assert res.verdict == PASS, res.reason + res.error
    assert any("rope" in i.module and i.dtype == "float32" for i in res.islands), res.islands


def test_vocab_parallel_embedding_partial_declared_replicate_fails_at_forward(sp_check):
    res = sp_check(_config("EMBEDDING_PARTIAL_AS_REPLICATE", world_size=2, dtype="float32", steps=1))
    assert res.verdict == FAIL and res.first_check == "forward", res.reason + res.error
    # the DTensor model is traced: the first comparable module is out, and the vocab-parallel
    # embedding before it, which the trace cannot compare, is named as where the error may enter
    d = res.divergence
    assert d is not None and d.phase == "forward" and d.upstream == ("tok_embeddings",), d and d.describe()


def test_a_run_at_another_tp_is_unsupported_naming_both(sp_check):
    res = sp_check(_config("LLAMA3_SP_TP2", world_size=4))
    assert res.verdict == UNSUPPORTED and "TP 2" in res.reason and "TP 4" in res.reason, res.reason
