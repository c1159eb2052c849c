"""DeepSpeed-Ulysses as a system under test (sp_harness.cases.frameworks.deepspeed.case; 0.19.8 pinned,
each release of compat.RELEASES in the release matrix),
on real gloo ranks: DeepSpeed's own DistributedAttention around a user's local attention (SDPA)
in the reference GPT, its grads reduced by DeepSpeed's engine (float32, bfloat16) or the same sums
written out (float64, which the engine refuses), against the same GPT unsharded; and a bug from
DeepSpeed's tracker (#8491: no grad back through the all-to-all) that must FAIL at the grads."""

import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("deepspeed", "DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from sp_harness.cases.frameworks.deepspeed import compat  # noqa: E402
from sp_harness.cases.frameworks.deepspeed.cases import BUG_6774, BUG_8317  # noqa: E402
from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402

EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "deepspeed_case.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; DeepSpeed's import and its CPU op build are the case's setup."""


def _config(name: str, **fields) -> CheckConfig:
    return CheckConfig(case=f"{EXAMPLE}:{name}", timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("fields", [dict(world_size=2, adversary="reorder"), dict(world_size=4, dp=2)],
                         ids=["sp2-reorder", "dp2xsp2"])
def test_distributed_attention_with_the_engine_passes_at_float32(sp_check, fields):
    res = sp_check(_config("DS_ULYSSES", dtype="float32", **fields))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)


def test_four_heads_over_sp4_pass_at_bfloat16_in_seq_first_layout(sp_check):
    res = sp_check(_config("DS_ULYSSES", world_size=4, dtype="bfloat16", layout="sbh"))
    # one local head over SP 4: the releases with #6774 take the uneven path and assert; those with
    # #8317 reshape the seq-first output to a zero-sized head dim and raise
    shipped = [bug for bug in (BUG_6774, BUG_8317) if bug.present()]
    if shipped:
        assert res.verdict == FAIL and res.first_check == "crash", res.reason + res.error
        assert ("Number of heads" if shipped[0] is BUG_6774 else "is invalid for input") in res.reason, res.reason
        return
    assert res.verdict == PASS, res.reason + res.error


@pytest.mark.exhaustive("the fast tier runs ds-ulysses-f64 (DistributedAttention in float64, the grad sum written "
                        "out) on 2 ranks by name below")
def test_float64_with_the_grad_sum_written_out_passes(sp_check):
    res = sp_check(_config("DS_ULYSSES_F64", world_size=2, dtype="float64"))
    assert res.verdict == PASS, res.reason + res.error


@pytest.mark.exhaustive("the fast tier kills mutant-ds-ulysses-detached-a2a (the same shard) in test_mutants")
def test_all_to_all_without_its_grad_fails_at_grad(sp_check):
    res = sp_check(_config("DETACHED", world_size=2, dtype="float32"))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason + res.error
    assert "_proj" in res.reason


def test_deepspeeds_own_limits_are_unsupported_before_any_rank_runs(sp_check):
    res = sp_check(_config("DS_ULYSSES", world_size=3, seq_len=10))
    assert res.verdict == UNSUPPORTED and "#7384" in res.reason, res.reason
    res = sp_check(_config("DS_ULYSSES", world_size=2, dtype="float64"))
    assert res.verdict == UNSUPPORTED and "torch.float64" in res.reason, res.reason


def test_ulysses_sp_attention_hf_on_a_tiny_llama_passes(sp_check):
    skip_unless_installed("transformers", "transformers is not installed (the deepspeed extra installs it)")
    # 4 query heads, 2 k/v heads over SP 2; DeepSpeed registers itself over transformers' sdpa
    res = sp_check(_config("HF_LLAMA", world_size=2, dtype="float32"))
    if compat.lacks(compat.ULYSSES_HF):  # before 0.17.0: UNSUPPORTED before any rank, naming the API
        assert res.verdict == UNSUPPORTED and compat.ULYSSES_HF in res.reason, res.reason
        return
    assert res.verdict == PASS, res.reason + res.error


@pytest.mark.parametrize("case", ["ds-ulysses-f64", "ds-ulysses-hf-llama"])
def test_the_built_in_cases_reach_their_nightly_verdict(sp_check, case):
    # the registered cases `sp-harness nightly` runs by name (their first example), beside this
    # file's examples/ twins of them
    from sp_harness.config.registry import get_case
    from sp_harness.judge.expect import expected_verdict

    config = get_case(case).examples[0].config(case)
    res = sp_check(config)
    runs = not (case.startswith("ds-ulysses-hf") and compat.lacks(compat.ULYSSES_HF))
    assert res.verdict == expected_verdict(config) == (PASS if runs else UNSUPPORTED), res.reason + res.error


def test_the_bench_runs_the_hf_case_bare_after_its_check(sp_check, sp_pool):
    # `sp-harness bench` crashed here ("query input tensor does not match the required shape"):
    # its bare job ran the reference in the rank, where the check before it had left DeepSpeed's
    # UlyssesSPAttentionHF in transformers' attention table; it now computes where a check's does
    from sp_harness.suites.bench_bare import timed_bare
    from sp_harness.suites.bench_realistic import realistic_config, runnable

    if compat.lacks(compat.ULYSSES_HF):
        pytest.skip(f"this DeepSpeed lacks {compat.ULYSSES_HF} (0.17.0 added it)")

    config = runnable(realistic_config("ds-ulysses-hf-llama", 2, 256, 32))
    assert config is not None and config.hidden == 256
    config = config.replace(steps=1)
    assert sp_check(config).verdict == PASS
    assert len(timed_bare(config, sp_pool, 1)) == 1


OWN_MODULE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "deepspeed_own_module.py")
HF_QWEN2 = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "deepspeed_hf_qwen2.py")


def test_the_users_own_module_with_distributed_attention_passes(sp_check):
    # examples/deepspeed_own_module.py: the user's model, DistributedAttention placed by `attention(...)`
    res = sp_check(CheckConfig(case=f"{OWN_MODULE}:OWN", world_size=2, dtype="float32", timeout_s=TIMEOUT_S))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)


def test_zero_stage_2_passes_and_stage_3_is_unsupported_before_any_rank(sp_check):
    # SP 2: ZeRO-2 partitions over the sequence-data-parallel group (both ranks); DP 2 x SP 2: full tier
    res = sp_check(CheckConfig(case="ds-ulysses-zero2", world_size=2, timeout_s=TIMEOUT_S))
    if compat.lacks(compat.ZERO_TORCH_BACKWARD):  # before 0.17.2: ZeRO reduces only inside engine.backward
        assert res.verdict == UNSUPPORTED and "IPGBucket" in res.reason, res.reason
    else:
        assert res.verdict == PASS, res.reason + res.error
    from types import SimpleNamespace

    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.deepspeed.case import ulysses_case

    zero3 = ulysses_case("x", ds_config={"zero_optimization": {"stage": 3}})
    cfg = SimpleNamespace(world_size=2, dp=1, num_heads=4, num_kv_heads=None, hidden=32, ring_degree=None,
                          load_balancer=None, seq_shards=None, seq_len=12, dtype="float32")
    with pytest.raises(Unsupported, match="ZeRO-3"):
        zero3.validate(cfg)


def test_hf_qwen2_passes_in_float64_with_the_sums_written_out(sp_check):
    skip_unless_installed("transformers", "transformers is not installed (the deepspeed extra installs it)")
    if compat.lacks(compat.ULYSSES_HF):
        pytest.skip(f"this DeepSpeed lacks {compat.ULYSSES_HF} (test_ulysses_sp_attention_hf_... checks the reason)")
    res = sp_check(CheckConfig(case="ds-ulysses-hf-qwen2", world_size=2, dtype="float64", timeout_s=TIMEOUT_S))
    assert res.verdict == PASS, res.reason + res.error
    res = sp_check(CheckConfig(case=f"{HF_QWEN2}:QWEN2", world_size=2, dtype="float64", timeout_s=TIMEOUT_S))
    assert res.verdict == UNSUPPORTED and "torch.float64" in res.reason, res.reason


def test_bad_engine_arguments_are_value_errors_naming_the_value():
    from sp_harness.cases.frameworks.deepspeed.hf import hf_ulysses_case
    from sp_harness.cases.frameworks.deepspeed.module import ulysses_module_case

    with pytest.raises(ValueError, match="grad_sync='engine'"):
        ulysses_module_case("x", lambda cfg, attention: None, grad_sync="all-reduce",
                            ds_config={"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="'nope' is not a transformers model type"):
        hf_ulysses_case("x", model_type="nope")


@pytest.mark.exhaustive("the fast tier runs OWN at float32 SP 2 and ds-ulysses-zero2 at SP 2")
@pytest.mark.parametrize("example, fields", [
    ("ds-ulysses-zero2", dict(world_size=4, dp=2, dtype="float32")),
    (f"{OWN_MODULE}:OWN", dict(world_size=4, dp=2, dtype="bfloat16")),
    (f"{OWN_MODULE}:OWN_ZERO2", dict(world_size=4, dp=2, dtype="float32")),
    (f"{OWN_MODULE}:OWN_F64", dict(world_size=2, dtype="float64")),
    (f"{HF_QWEN2}:QWEN2", dict(world_size=2, dtype="float32")),
    (f"{HF_QWEN2}:QWEN2", dict(world_size=4, dp=2, dtype="bfloat16")),
    (f"{HF_QWEN2}:QWEN2_ZERO2", dict(world_size=4, dp=2, dtype="float32")),
    (f"{HF_QWEN2}:QWEN2_F64", dict(world_size=2, dtype="float64")),
], ids=["zero2-dp2", "own-bf16-dp2", "own-zero2", "own-f64", "qwen2-f32", "qwen2-bf16-dp2", "qwen2-zero2", "qwen2-f64"])
def test_the_examples_pass_in_every_dtype_deepspeed_allows(sp_check, example, fields):
    res = sp_check(CheckConfig(case=example, timeout_s=TIMEOUT_S, **fields))
    assert res.verdict == PASS, res.reason + res.error


TOKEN_LOSS = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "deepspeed_token_loss.py")


def test_your_labels_padding_smoothing_and_loss_function_pass(sp_check):
    # examples/deepspeed_token_loss.py on one pool of 2: an HF Qwen2 with -100 labels (a quarter of
    # each sequence, 2 trailing pads) and label smoothing 0.1; the user's own module with the same
    # masks and a z-loss of the user's own. Each SP rank's loss is its shard's sum over the
    # sequence's valid tokens
    skip_unless_installed("transformers", "transformers is not installed (the deepspeed extra installs it)")
    for name in ("QWEN2_SFT", "OWN_Z_LOSS")[compat.lacks(compat.ULYSSES_HF):]:
        res = sp_check(CheckConfig(case=f"{TOKEN_LOSS}:{name}", world_size=2, dtype="float32", timeout_s=TIMEOUT_S))
        assert res.verdict == PASS, name + res.reason + res.error
        assert res.worst["loss"].ratio < 1, name


def test_a_token_loss_the_run_cannot_honour_is_refused_before_any_rank():
    from types import SimpleNamespace

    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.deepspeed.case import ulysses_case
    from sp_harness.cases.frameworks.deepspeed.loss import sp_local_loss
    from sp_harness.cases.frameworks.token_loss import TokenLoss

    case = ulysses_case("x", loss=TokenLoss(padding=2))
    cfg = SimpleNamespace(world_size=2, dp=1, num_heads=4, num_kv_heads=None, hidden=32, ring_degree=None,
                          load_balancer=None, seq_shards=None, seq_len=12, dtype="float32", causal=False)
    with pytest.raises(Unsupported, match="key-padding mask"):
        case.validate(cfg)
    with pytest.raises(ValueError, match="TokenLoss.padding 12 leaves no position"):
        ulysses_case("x", loss=TokenLoss(padding=12)).validate(SimpleNamespace(**{**vars(cfg), "causal": True}))
    with pytest.raises(ValueError, match="normalise 'rank'"):
        sp_local_loss(TokenLoss(), "rank")


@pytest.mark.exhaustive("the fast tier runs QWEN2_SFT and OWN_Z_LOSS at float32 on 2 ranks")
@pytest.mark.parametrize("name, fields", [
    ("QWEN2_SFT", dict(world_size=4, dp=2, dtype="bfloat16")),
    ("QWEN2_SFT_F64", dict(world_size=2, dtype="float64")),
    ("OWN_Z_LOSS", dict(world_size=4, dp=2, dtype="bfloat16")),
], ids=["qwen2-sft-bf16-dp2", "qwen2-sft-f64", "own-z-loss-bf16-dp2"])
def test_your_loss_passes_in_every_dtype_deepspeed_allows(sp_check, name, fields):
    res = sp_check(CheckConfig(case=f"{TOKEN_LOSS}:{name}", timeout_s=TIMEOUT_S, **fields))
    assert res.verdict == PASS, res.reason + res.error


@pytest.mark.exhaustive("the fast tier kills mutant-ds-ulysses-hf-exchange-detached at its pinned grad check in "
                        "test_mutants")
def test_a_detached_exchange_fails_exactly_where_8491_says(sp_check):
    # deepspeedai/DeepSpeed#8491: no grad reaches the attention's q/k/v projections while o_proj and the
    # MLPs update normally. In the last layer those grads are untouched (nothing after them crosses the
    # exchange), so they must pass while its q/k/v fail; the divergence is a backward one in that layer
    skip_unless_installed("transformers", "transformers is not installed (the deepspeed extra installs it)")
    res = sp_check(CheckConfig(case="mutant-ds-ulysses-hf-exchange-detached", world_size=2, timeout_s=TIMEOUT_S))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason + res.error
    names = set(res.failing_names)
    last = "grad:lm.model.layers.1."
    assert {f"{last}self_attn.{p}_proj.weight" for p in "qkv"} <= names, sorted(names)
    assert not any(n.startswith((f"{last}self_attn.o_proj", f"{last}mlp.")) for n in names), sorted(names)
    assert res.divergence.phase == "backward" and res.divergence.module == "lm.model.layers.1.self_attn", \
        res.divergence.describe()
