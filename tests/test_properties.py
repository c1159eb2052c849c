"""Property tests: every built-in case agrees with its reference over generated configs.

World sizes, uneven (and empty) sequence shards, head counts and widths not divisible by the
world size, dtypes, norms, layouts, seeds and step counts come from sp_harness.config.strategies; the
verdict must be the one sp_harness.judge.expect predicts, natively and under the reorder adversary. On failure hypothesis shrinks to a minimal
config and the assertion message carries the one-line repro.
"""

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from sp_harness.config.strategies import adversaries, gpt_configs, mlp_configs, training_sized_configs
from sp_harness.judge.expect import expected_verdict
from sp_harness.report.result_text import format_result


def _judge(sp_check, config):
    res = sp_check(config)
    want = expected_verdict(config)
    note(format_result(res))
    assert res.verdict == want, (
        f"{config.case}: expected {want}, got {res.verdict}: {res.reason.splitlines()[0] if res.reason else ''}\n"
        f"repro: {res.config.repro()}"
    )
    return res


@pytest.mark.parametrize("case", ["megatron-gpt-sp", pytest.param("megatron-gpt-tp", marks=pytest.mark.exhaustive(
    "the fast tier draws megatron-gpt-sp's configs here (the same model, strategy and reference; TP plus the "
    "sequence split); megatron-gpt-tp passes as test_mutants' twin (even, dp2xtp2) and in test_other_kernels "
    "(float32 under reorder-tf32)"))])
@given(data=st.data())
def test_megatron_cases_match_reference(sp_check, sp_max_world_size, case, data):
    config = data.draw(gpt_configs(case, max_world_size=sp_max_world_size,
                                   adversary_choices=adversaries(include_off=True)), label="config")
    _judge(sp_check, config)


@given(data=st.data())
def test_megatron_reference_mode_on_dp_replicas(sp_check, data):
    config = data.draw(gpt_configs("megatron-gpt-ref", max_world_size=1,
                                   adversary_choices=adversaries(include_off=True)), label="config")
    dp = data.draw(st.integers(1, 2), label="dp")
    _judge(sp_check, config.replace(world_size=dp, dp=dp, seq_shards=None))


@given(data=st.data())
def test_dtensor_gpt_verdicts(sp_check, sp_max_world_size, data):
    config = data.draw(gpt_configs("dtensor-gpt", max_world_size=sp_max_world_size, max_dp=1, chunk_only=True,
                                   adversary_choices=adversaries(include_off=True)), label="config")
    _judge(sp_check, config)


@given(data=st.data())
def test_seed_mlp_verdicts(sp_check, sp_max_world_size, data):
    config = data.draw(mlp_configs(max_world_size=sp_max_world_size, adversary_choices=adversaries(include_off=True)),
                       label="config")
    _judge(sp_check, config)


@given(data=st.data())
def test_training_sized_configs_are_training_sized_and_keep_the_case_and_mesh(data):
    small = gpt_configs("megatron-gpt-sp", max_world_size=4)
    config = data.draw(training_sized_configs(small, max_tokens=300))
    assert config.hidden >= 256 and 256 <= config.seq_len <= 300 and config.num_layers >= 2
    assert config.case == "megatron-gpt-sp" and config.hidden % (config.world_size // config.dp) == 0
    assert expected_verdict(config) == "PASS"


def test_training_sized_configs_validates_its_bounds():
    small = gpt_configs("megatron-gpt-sp", max_world_size=2)
    with pytest.raises(ValueError, match="min_tokens"):
        training_sized_configs(small, min_tokens=300, max_tokens=200)
    with pytest.raises(ValueError, match="max_layers"):
        training_sized_configs(small, max_layers=1)
