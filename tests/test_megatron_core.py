"""megatron-core 0.16.1 as a system under test (sp_harness.cases.frameworks.megatron_core), on real
gloo ranks: its GPTModel with sequence_parallel=True at TP 2 and 4 against the same model at TP=1,
its own DDP (`main_grad`) and `finalize_model_grads`, and GPT-NeoX #1257 expressed through
megatron's own `sequence_parallel` param flag, which must FAIL at the grads."""

import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("megatron.core", "megatron-core is not installed (pip install -e '.[megatron]')")

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402

EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "megatron_core_case.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; megatron-core's import is the case's setup, outside it."""


def _config(name: str, **fields) -> CheckConfig:
    return CheckConfig(case=f"{EXAMPLE}:{name}", timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("name,world_size", [("GPT_SP_TP2", 2), pytest.param(
    "GPT_SP_TP4", 4, marks=pytest.mark.exhaustive("the fast tier runs GPT_SP_TP2 at 2 ranks, and TP 2 x DP 2 below"))])
def test_sequence_parallel_gpt_passes_at_float32(sp_check, name, world_size):
    res = sp_check(_config(name, world_size=world_size, dtype="float32"))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)


def test_gathered_logits_pass_at_float64(sp_check):
    res = sp_check(_config("GPT_SP_TP2_GATHERED", world_size=2, dtype="float64"))
    assert res.verdict == PASS, res.reason + res.error


def test_float64_vocab_parallel_loss_passes_with_megatrons_float32_island_on_both_sides(sp_check):
    # megatron's vocab_parallel_cross_entropy casts the logits to float32: the references compute
    # their loss in float32 too, and a tensor the float64 reference itself computed in float32 is
    # judged at float32's floor. The island is found and named.
    res = sp_check(_config("GPT_SP_TP2", world_size=2, dtype="float64"))
    assert res.verdict == PASS, res.reason + res.error
    assert res.worst["forward"].ratio < 1 and res.worst["grad"].ratio < 1
    assert any(i.module == "loss" and i.dtype == "float32" for i in res.islands), res.islands
    assert not any("triu" in i.op for i in res.islands), res.islands  # the CPU shim's mask is bool


def test_norm_param_without_its_sequence_parallel_flag_fails_at_grad(sp_check):
    res = sp_check(_config("NORM_FLAG_DROPPED", world_size=2, dtype="float32"))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason + res.error
    assert "input_layernorm.weight" in res.reason


def test_a_run_at_another_tp_is_unsupported_naming_both(sp_check):
    res = sp_check(_config("GPT_SP_TP2", world_size=4))
    assert res.verdict == UNSUPPORTED and "TP 2" in res.reason and "TP 4" in res.reason, res.reason


def test_converge_trains_megatron_sp_in_lockstep_with_its_tp_twin_and_the_reference(sp_pool, tmp_path):
    from sp_harness.suites.converge import ConvergeOptions, converge

    opts = ConvergeOptions(case="mcore-gpt-sp", steps=6, seq_len=16, batch=2, warmup_steps=2)
    result, _, runs = converge(opts, sp_pool, tmp_path, progress=False)
    assert result.passed, result.reasons
    assert set(runs) == {"ref", "tp", "sp"}  # megatron TP=1, TP 2, TP 2 + SP


def test_converge_fails_megatron_norm_flag_dropped_naming_the_norm(sp_pool, tmp_path):
    from sp_harness.suites.converge import ConvergeOptions, converge

    opts = ConvergeOptions(case="mutant-mcore-norm-flag-dropped", steps=6, seq_len=16, batch=2, warmup_steps=2)
    result, _, _ = converge(opts, sp_pool, tmp_path, progress=False)
    assert not result.passed
    assert result.first_failing_step is not None and result.first_failing_step <= 2
    assert "layernorm" in (result.first_failing_param or ""), result.reasons


def test_the_built_in_tp_case_reaches_its_nightly_verdict(sp_check):
    # mcore-gpt-tp, the built-in SP case's baseline and twin, run by name as `sp-harness nightly` runs it
    from sp_harness.config.registry import get_case
    from sp_harness.judge.expect import expected_verdict

    config = get_case("mcore-gpt-tp").examples[0].config("mcore-gpt-tp")
    res = sp_check(config)
    assert res.verdict == expected_verdict(config) == PASS, res.reason + res.error
