"""megatron-core 0.16.1 as a system under test (sp_harness.cases.frameworks.megatron.case), on real
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

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = os.path.join(EXAMPLES, "megatron_core_case.py")
LLAMA_EXAMPLE = os.path.join(EXAMPLES, "megatron_llama_case.py")
MOE_EXAMPLE = os.path.join(EXAMPLES, "megatron_moe_case.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; megatron-core's import is the case's setup, outside it."""


def _config(name: str, example: str = EXAMPLE, **fields) -> CheckConfig:
    return CheckConfig(case=f"{example}:{name}", timeout_s=TIMEOUT_S, **fields)


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


@pytest.mark.exhaustive("test_mutants kills mutant-mcore-norm-flag-dropped (the same edit on the registered twin) at grad")
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


@pytest.mark.exhaustive("test_converge's unsynced-norm run fails converge by step 2 naming the norm (the same "
                        "lockstep judgement), megatron's converge runs above, and test_mutants kills "
                        "mutant-mcore-norm-flag-dropped at the grads")
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


# ------------------------------------------------------------------ the user's model: Llama-style, MoE

FULL = "the fast tier runs the Llama example in bfloat16 and mcore-moe-sp as its mutant's twin"


@pytest.mark.parametrize("example,name,dtype", [
    (LLAMA_EXAMPLE, "LLAMA", "bfloat16"),
    pytest.param(MOE_EXAMPLE, "MOE", "bfloat16", marks=pytest.mark.exhaustive(
        "the fast tier runs mcore-moe-sp, the same MoE model, as the twin of its mutant")),
    pytest.param(LLAMA_EXAMPLE, "LLAMA", "float32", marks=pytest.mark.exhaustive(FULL)),
    pytest.param(LLAMA_EXAMPLE, "LLAMA", "float64", marks=pytest.mark.exhaustive(FULL)),
    pytest.param(LLAMA_EXAMPLE, "LLAMA_QK_NORM", "float32", marks=pytest.mark.exhaustive(FULL)),
    pytest.param(MOE_EXAMPLE, "MOE", "float32", marks=pytest.mark.exhaustive(FULL)),
    pytest.param(MOE_EXAMPLE, "MOE", "float64", marks=pytest.mark.exhaustive(FULL))])
def test_a_llama_style_and_an_moe_model_pass(sp_check, example, name, dtype):
    # SwiGLU's fc1 is TP-split with partition_stride 2 (a ParamSpec.index view of the blocks), RoPE
    # and tied embeddings reach both GPTModels, GQA and the experts come from the TransformerConfig
    res = sp_check(_config(name, example, world_size=2, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)


@pytest.mark.exhaustive("the fast tier runs the Llama example at TP 2")
def test_the_llama_style_model_passes_at_dp2_tp2(sp_check):
    res = sp_check(_config("LLAMA", LLAMA_EXAMPLE, world_size=4, dp=2, dtype="float32"))
    assert res.verdict == PASS, res.reason + res.error


@pytest.mark.parametrize("changes,words", [
    (dict(moe_grouped_gemm=True), "TransformerEngine"),
    (dict(expert_model_parallel_size=2), "expert parallelism"),
    (dict(add_bias_linear=True), "expert_tensor_parallel_size 1"),
    (dict(expert_tensor_parallel_size=1), "expert_tensor_parallel_size 1"),
    (dict(moe_token_dispatcher_type="flex"), "DeepEP"),
    (dict(num_query_groups=3), r"num_query_groups \(3\)"),
    (dict(moe_aux_loss_coeff=0.01, dp=2), "each DP replica's tokens")])
def test_what_megatron_cannot_run_here_is_unsupported_from_the_config(changes, words):
    # decided by validate, before any rank starts (no megatron import)
    from sp_harness.cases.frameworks.megatron.case import megatron_case
    from sp_harness.config.case import Unsupported

    moe = dict(num_layers=2, hidden_size=32, num_attention_heads=4, add_bias_linear=False, num_moe_experts=4,
               sequence_parallel=True)
    changes = dict(changes)
    dp = changes.pop("dp", 1)
    case = megatron_case("mcore-moe-variant", {**moe, **changes}, tp=2)
    with pytest.raises(Unsupported, match=words):
        case.validate(case.resolve(CheckConfig(case=case.name, world_size=2 * dp, dp=dp)))


def test_gpt_model_arguments_the_run_owns_are_refused_naming_the_valid_ones():
    from sp_harness.cases.frameworks.megatron.case import megatron_case

    with pytest.raises(ValueError, match="vocab_size.*rotary_base"):
        megatron_case("bad", dict(num_layers=2), gpt_kwargs=dict(vocab_size=10))
    with pytest.raises(ValueError, match="'mrope'"):
        megatron_case("bad", dict(num_layers=2), gpt_kwargs=dict(position_embedding_type="mrope"))


def test_the_strided_index_is_megatrons_own_split():
    # megatron's _initialize_affine_weight_cpu: chunks of size D / (stride * tp), rank r takes
    # weight_list[r::tp]; the index is a view of the reference with those elements in that order
    import torch

    from sp_harness.cases.frameworks.megatron.case import strided_index

    full = torch.arange(8 * 3).reshape(8, 3)
    for dim in (0, 1):
        ref = full if dim == 0 else full.t()
        for r in range(2):
            chunks = torch.split(ref, ref.shape[dim] // 4, dim=dim)
            want = torch.cat(chunks[r::2], dim=dim)
            view = strided_index(dim, 2, 2, r)(ref)
            assert view.numel() == want.numel() and view._base is not None
            assert torch.equal(view.reshape(want.shape), want)


# ------------------------------------------------------------------ your loss and your batch

LOSS_EXAMPLE = os.path.join(EXAMPLES, "megatron_loss_case.py")
MODULE_EXAMPLE = os.path.join(EXAMPLES, "megatron_module_case.py")


def test_token_loss_is_the_dense_target_distribution_and_masks_every_sequence_alike():
    # pure: the reference side of a TokenLoss against the loss written from its definition
    import torch
    import torch.nn.functional as F

    from sp_harness.cases.frameworks.token_loss import TokenLoss, mask_labels, token_losses, valid_tokens

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    eps, vocab = 0.1, 11
    onehot = F.one_hot(labels, vocab).double()
    logp = torch.log_softmax(logits, dim=-1)
    # megatron's convention: eps spread over the V - 1 other classes; torch's over all V
    others = -((1 - eps) * onehot + eps / (vocab - 1) * (1 - onehot)) * logp
    uniform = -((1 - eps) * onehot + eps / vocab) * logp
    smoothed = TokenLoss(label_smoothing=eps)
    torch.testing.assert_close(token_losses(smoothed, logits, labels, smoothing="others"), others.sum(-1))
    torch.testing.assert_close(token_losses(smoothed, logits, labels), uniform.sum(-1))
    masked = TokenLoss(masked_fraction=0.5, padding=1, loss_fn=lambda x, y: x.logsumexp(-1) - x.gather(
        -1, y[..., None]).squeeze(-1))
    state = gen.get_state()
    target = mask_labels(masked, labels, gen)
    assert (target[:, -1] == -100).all() and ((target == -100).sum(1) == 1 + 2).all(), target  # floor(0.5 x 4) + pad
    assert valid_tokens(masked, target) == 3 * 2
    per = token_losses(masked, logits, target)
    torch.testing.assert_close(per, torch.where(target != -100, -logp.gather(-1, labels[..., None]).squeeze(-1), 0.0))
    gen.set_state(state)
    assert torch.equal(mask_labels(TokenLoss(), labels, gen), labels) and torch.equal(gen.get_state(), state)
    with pytest.raises(ValueError, match="label_smoothing 1.0"):
        TokenLoss(label_smoothing=1.0)
    with pytest.raises(ValueError, match="padding 5 leaves no position of a 5-token"):
        mask_labels(TokenLoss(padding=5), labels, gen)


def test_a_loss_megatron_cannot_express_is_refused_naming_why():
    from sp_harness.cases.frameworks.megatron.case import megatron_case
    from sp_harness.cases.frameworks.token_loss import TokenLoss

    with pytest.raises(ValueError, match="no label smoothing"):
        megatron_case("bad", dict(num_layers=2), loss=TokenLoss(label_smoothing=0.1), model_loss=True)
    with pytest.raises(ValueError, match="vocab_parallel_loss=False"):
        megatron_case("bad", dict(num_layers=2), loss=TokenLoss(loss_fn=lambda x, y: x.sum(-1)))


def test_a_loss_mask_padding_and_label_smoothing_pass_at_dp2_with_the_global_token_count(sp_check):
    # calculate_per_token_loss: megatron's DDP sums over DP, finalize_model_grads divides by the valid
    # tokens all-reduced over DP; label smoothing with the whole vocabulary's statistics (#7466)
    res = sp_check(CheckConfig(case="mcore-gpt-sp-loss", world_size=4, dp=2, dtype="float32",
                               timeout_s=TIMEOUT_S))
    assert res.verdict == PASS, res.reason + res.error


def test_megatrons_loss_bugs_are_placed_in_the_loss_and_after_the_final_norm(sp_check):
    # #7452 finding 1: the output agrees, the loss does not; finding 2: the GPTModel's loss over
    # gathered logits, after the last module that agrees
    res = sp_check(CheckConfig(case="mutant-mcore-label-smoothing-local-vocab", world_size=2, dtype="float32",
                               steps=1, timeout_s=TIMEOUT_S))
    assert res.verdict == FAIL and res.first_check == "loss", res.reason + res.error
    assert res.divergence is not None and res.divergence.phase == "loss", res.divergence
    res = sp_check(CheckConfig(case="mutant-mcore-gathered-logits-labels", world_size=2, dtype="float32", steps=1,
                               timeout_s=TIMEOUT_S))
    assert res.verdict == FAIL and res.first_check == "forward", res.reason + res.error
    d = res.divergence
    assert d is not None and d.phase == "unaligned" and d.note.split("compared: ")[1].startswith("'output_layer'"), d


@pytest.mark.parametrize("name,world_size,dp,dtype,verdict", [
    ("LLAMA_LOSS", 2, 1, "bfloat16", PASS), ("LLAMA_LABELS", 4, 2, "float32", PASS),
    ("LLAMA_USER_LOSS", 2, 1, "float64", PASS), ("LLAMA_MEGATRON_SMOOTHING", 2, 1, "float32", FAIL)])
@pytest.mark.exhaustive("the fast tier runs mcore-gpt-sp-loss at DP 2 and the loss mutants with their twins")
def test_the_llama_loss_examples(sp_check, name, world_size, dp, dtype, verdict):
    res = sp_check(_config(name, LOSS_EXAMPLE, world_size=world_size, dp=dp, dtype=dtype))
    assert res.verdict == verdict, res.reason + res.error


@pytest.mark.exhaustive("the fast tier runs mcore-gpt-sp-loss (per token) at DP 2")
def test_per_replica_normalisation_with_a_loss_mask_passes_at_dp2(sp_check):
    res = sp_check(_config("GPT_SP_TP2_MASKED", world_size=4, dp=2, dtype="float32"))
    assert res.verdict == PASS, res.reason + res.error


@pytest.mark.exhaustive("the fast tier kills mutant-mcore-xattn-global-tp-group at DP 2 x TP 2 with its twin")
def test_a_module_reading_the_global_tp_group_fails_naming_its_projections(sp_check):
    # megatron's CrossAttention (#7452 finding 6) against the fixed one, float64 too
    res = sp_check(_config("XATTN", MODULE_EXAMPLE, world_size=4, dp=2, dtype="float64"))
    assert res.verdict == PASS, res.reason + res.error
    res = sp_check(_config("XATTN_MEGATRON", MODULE_EXAMPLE, world_size=4, dp=2, dtype="float32", steps=1))
    assert res.verdict == FAIL and res.first_check == "forward", res.reason + res.error
    d = res.divergence
    assert d is not None and d.note.split("compared: ")[1].startswith(("'linear_kv'", "'linear_q'")), d
