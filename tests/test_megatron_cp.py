"""megatron-core's own context parallelism (`context_parallel_size` in the TransformerConfig keywords,
sp_harness.cases.frameworks.megatron.cp): its load-balanced batch cut, its CP groups, its DDP and
`finalize_model_grads` over DP x CP and its schedule's normalisation run with the exact CPU stand-in
for TransformerEngine's CP attention, and PASS at CP 2 and DP 2 x CP 2; the attention without its
K/V exchange FAILs at the forward; megatron's legacy normalisation FAILs at the grads (Megatron-LM
#7452 finding 9: 0.500x at one micro-batch, every valid token on one CP rank) where its per-token
normalisation PASSes; what the integration would not apply is UNSUPPORTED, never a silent PASS."""

import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("megatron.core", "megatron-core is not installed (pip install -e '.[megatron]')")

from sp_harness.cases.frameworks.megatron import megatron_case  # noqa: E402
from sp_harness.cases.frameworks.token_loss import TokenLoss  # noqa: E402
from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402
from sp_harness.report.result_text import format_result  # noqa: E402

EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "megatron_cp_case.py")
TIMEOUT_S = 180.0
"""Generous for a loaded runner (a DP 2 x CP 2 step check takes about 20 s on 2 busy cores);
megatron-core's import is the case's setup, outside it."""
STEP = dict(train_step=True, micro_batches=3, clip_grad_norm=0.01, optimizer="sgd")
"""K = 3 uneven micro-batches (the last empty, the last CP rank of the last replica without a valid
token), clipping active at every step."""

# this file is also the case file of the cases below (CheckConfig(case=f"{__file__}:NAME")), loaded by the ranks
CP = dict(num_layers=2, hidden_size=32, num_attention_heads=4, context_parallel_size=2, calculate_per_token_loss=True)
ROPE = megatron_case("mcore-gpt-cp-rope", CP, tp=1, isolation="megatron-core",
                     gpt_kwargs=dict(position_embedding_type="rope"))


def _no_attention(tconfig):
    """megatron's local layer spec with its self-attention replaced by the identity: a model with
    nothing context-parallel in it."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_layer_local_spec()
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=IdentityOp,
                                                                    self_attn_bda=IdentityOp))


NO_ATTENTION = megatron_case("mcore-gpt-cp-no-attention", CP, tp=1, isolation="megatron-core", layer_spec=_no_attention)
CP_TP2 = megatron_case("mcore-gpt-cp-tp2", CP, tp=2, isolation="megatron-core")
PADDED = megatron_case("mcore-gpt-cp-padded", CP, tp=1, isolation="megatron-core", loss=TokenLoss(padding=2))
A2A = megatron_case("mcore-gpt-cp-a2a", {**CP, "cp_comm_type": "a2a"}, tp=1, isolation="megatron-core")
MOE_AUX = megatron_case("mcore-gpt-cp-moe-aux", {**CP, "num_moe_experts": 4, "moe_aux_loss_coeff": 0.01,
                                                 "add_bias_linear": False}, tp=1, isolation="megatron-core")
PIPELINE = megatron_case("mcore-gpt-cp-pp2", {**CP, "pipeline_model_parallel_size": 2}, tp=1,
                         isolation="megatron-core")


def _config(name: str, **fields) -> CheckConfig:
    """`name`: a built-in case (mcore-..., release-...), an attribute of the example, or one of
    this file's (here:NAME)."""
    if name.startswith(("mcore-", "release-", "mutant-")):
        case = name
    elif name.startswith("here:"):
        case = f"{__file__}:{name[len('here:'):]}"
    else:
        case = f"{EXAMPLE}:{name}"
    return CheckConfig(case=case, timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("name, fields", [
    ("GPT_CP", dict(world_size=4, dp=2, dtype="float32")),
    pytest.param("mcore-gpt-cp", dict(world_size=2, dtype="float64"), marks=pytest.mark.exhaustive(
        "test_mutants runs mcore-gpt-cp at CP 2 in float64 (the twin of mutant-mcore-cp-kv-not-gathered)")),
    pytest.param("here:ROPE", dict(world_size=2, dtype="float32"), marks=pytest.mark.exhaustive(
        "the fast tier runs learned positions at DP 2 x CP 2; RoPE's per-rank frequencies are megatron's CP cut")),
])
def test_megatron_context_parallelism_passes_side_by_side(sp_check, name, fields):
    res = sp_check(_config(name, **fields))
    assert res.verdict == PASS, format_result(res)
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)


@pytest.mark.parametrize("name, fields", [
    ("GPT_CP_STEP", dict(world_size=4, dp=2, dtype="float32")),
    pytest.param("GPT_CP_STEP", dict(world_size=4, dp=2, dtype="bfloat16", optimizer="adamw"),
                 marks=pytest.mark.exhaustive("the fast tier runs the CP step at DP 2 x CP 2 in float32 with SGD")),
    pytest.param("GPT_CP_STEP", dict(world_size=2, dtype="float32"),
                 marks=pytest.mark.exhaustive("the fast tier runs the CP step at DP 2 x CP 2")),
])
def test_megatrons_own_step_with_context_parallelism_passes(sp_check, name, fields):
    res = sp_check(_config(name, **{**STEP, **fields}))
    assert res.verdict == PASS, format_result(res)
    stages = {"loss", "grad", "grad_norm", "param"} | ({"clip"} if res.config.optimizer == "sgd" else set())
    assert stages <= set(res.worst), (stages, set(res.worst))


def test_legacy_normalisation_by_each_cp_ranks_own_count_fails_at_the_grads(sp_check):
    # megatron-core's calculate_per_token_loss=False divides each CP rank's loss by its own valid
    # tokens; with one micro-batch the last CP rank holds none, so the grads are half the token
    # mean's, every one of them. The reported loss (sum / count over DP x CP) is right.
    res = sp_check(_config("release-mcore-7452-f9-cp-local-token-count", world_size=2, **{**STEP, "micro_batches": 1}))
    assert res.verdict == FAIL and res.first_check == "grad", format_result(res)
    assert res.grad_factor == pytest.approx(0.5, rel=1e-6) and "every param grad is 0.500x" in res.reason, res.reason
    assert "loss" not in {f.kind for f in res.failures}, res.reason


@pytest.mark.exhaustive("test_legacy_normalisation_by_each_cp_ranks_own_count_fails_at_the_grads runs it at CP 2, "
                        "and the release suite at DP 2 x CP 2")
def test_the_release_case_fails_at_dp2_x_cp2_where_its_per_token_control_passes(sp_check):
    bug = sp_check(_config("release-mcore-7452-f9-cp-local-token-count", world_size=4, dp=2, **STEP))
    assert bug.verdict == FAIL and bug.first_check == "grad", format_result(bug)
    control = sp_check(_config("mcore-gpt-cp-step", world_size=4, dp=2, **STEP))
    assert control.verdict == PASS, format_result(control)


def test_cp_on_a_layer_spec_without_attention_is_unsupported_not_a_pass(sp_check):
    res = sp_check(_config("here:NO_ATTENTION", world_size=2, dtype="float32"))
    assert res.verdict == UNSUPPORTED, format_result(res)
    assert "context_parallel_size=2" in res.reason and "without a core attention" in res.reason, res.reason


@pytest.mark.parametrize("name, fields, words", [
    ("GPT_CP", dict(world_size=3), ("world_size / dp = 3", "--world-size 2")),
    ("GPT_CP", dict(world_size=2, seq_len=10), ("divisible by 2 x CP (4)",)),
    ("here:CP_TP2", dict(world_size=2), ("tp=2", "megatron TP 1")),
    ("here:PADDED", dict(world_size=2), ("TokenLoss.padding 2",)),
    ("here:A2A", dict(world_size=2), ("cp_comm_type 'a2a'",)),
    ("here:PIPELINE", dict(world_size=2), ("pipeline_model_parallel_size=2", "not applied")),
    ("here:MOE_AUX", dict(world_size=2), ("moe_aux_loss_coeff 0.01 with CP",)),
])
def test_what_the_integration_would_not_apply_is_unsupported_before_any_rank_starts(sp_check, name, fields, words):
    res = sp_check(_config(name, **fields))
    assert res.verdict == UNSUPPORTED, format_result(res)
    assert all(w in res.reason for w in words), res.reason


def test_a_per_token_setting_the_step_would_override_is_a_value_error():
    from sp_harness.cases.frameworks.megatron import MegatronStepConfig, megatron_train_case

    with pytest.raises(ValueError, match="calculate_per_token_loss=False in the TransformerConfig keywords"):
        megatron_train_case("x", dict(calculate_per_token_loss=False),
                            step=MegatronStepConfig(calculate_per_token_loss=True))


def test_the_step_runs_the_normalisation_the_transformer_config_keywords_ask_for():
    from sp_harness.cases.frameworks.megatron import MegatronStepConfig
    from sp_harness.cases.frameworks.megatron.step import per_token_loss

    assert per_token_loss({"calculate_per_token_loss": False}, MegatronStepConfig()) is False
    assert per_token_loss({}, MegatronStepConfig()) is True
    assert per_token_loss({}, MegatronStepConfig(calculate_per_token_loss=False)) is False


def test_the_load_balanced_order_is_megatrons_get_batch_on_this_cp_rank():
    # the engine's cut of the target (the contract) against megatron's own cut of the inputs
    from unittest import mock

    import torch
    from megatron.core.utils import get_batch_on_this_cp_rank

    from sp_harness.cases.frameworks.megatron.compat import cp_batch_arguments
    from sp_harness.cases.frameworks.megatron.cp import cp_order

    seq, cp = 24, 3
    order = cp_order(seq, (seq // cp,) * cp)
    assert sorted(order.tolist()) == list(range(seq))

    class Group:  # a CP group of `cp` ranks: 0.15-0.16 ask the group, 0.17 on torch.distributed of it
        def __init__(self, rank: int) -> None:
            self._rank = rank

        def size(self) -> int:
            return cp

        def rank(self) -> int:
            return self._rank

    for rank in range(cp):
        # called with the arguments the case calls it with (the CP group by name)
        with mock.patch("megatron.core.parallel_state.get_context_parallel_group", return_value=Group(rank)), \
                mock.patch("torch.distributed.is_initialized", return_value=True), \
                mock.patch("torch.distributed.get_world_size", return_value=cp), \
                mock.patch("torch.distributed.get_rank", return_value=rank):
            cut = get_batch_on_this_cp_rank({"tokens": torch.arange(seq)[None]}, **cp_batch_arguments())["tokens"][0]
        assert cut.tolist() == order[rank * (seq // cp):(rank + 1) * (seq // cp)].tolist()
