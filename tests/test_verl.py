"""verl's own SFT training step with Ulysses SP (sp_harness.cases.frameworks.verl): verl 0.9.1's
FSDPEngineWithLMHead (FSDP2 over the world, ulysses_sequence_parallel_size 2) at DP 2 x SP 2 on real
gloo ranks, against the same HF model in float64 on one device over the whole global batch.

- verl's step PASSes every stage in bfloat16 and float32 (float32 and SGD with clipping active: the
  full tier here, float32 with SGD the fast tier's mutant twin).
- The grad sync that leaves the SP ranks out (VeOmni#1059) FAILs at the grads, its first reported
  loss still right; the other SP mutants (the full tier here; test_mutants kills each at its pin,
  battery entry train-step) FAIL at the reported loss.
- float64, which verl's engine does not take, is UNSUPPORTED before any rank starts.
- The flash-attn stand-in is exact attention over the packed segments (no ranks)."""

import pytest
from installed import skip_unless_installed

skip_unless_installed("verl", "verl is not installed (pip install --no-deps verl==0.9.1, then its extra)")
skip_unless_installed("tensordict", "tensordict is not installed (verl's extra)")
skip_unless_installed("ray", "ray is not installed (verl's extra: verl.protocol imports it)")
skip_unless_installed("transformers", "transformers is not installed (pip install -e '.[hf]')")

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402
from sp_harness.report.result_text import format_result  # noqa: E402

TIMEOUT_S = 300.0
"""Generous for a loaded 2-core runner: verl's and transformers' imports are the case's setup."""


def _sp(case: str, **fields) -> CheckConfig:
    fields = {"optimizer": "adamw", "dtype": "float32", "steps": 2, **fields}
    return CheckConfig(case=case, world_size=4, dp=2, train_step=True, micro_batches=2, timeout_s=TIMEOUT_S,
                       **fields)


@pytest.mark.parametrize("fields", [
    pytest.param(dict(dtype="float32"), marks=pytest.mark.exhaustive(
        "test_mutants runs verl-sft-sp-llama at DP 2 x SP 2 in float32 (SGD with clipping active, K=3) as the twin "
        "of its three mutants (battery entry train-step); the fast tier runs AdamW in bfloat16 here")),
    dict(dtype="bfloat16"),
    pytest.param(dict(optimizer="sgd", clip_grad_norm=0.01),
                 marks=pytest.mark.exhaustive("the battery's train-step entry runs SGD with clipping active, K=3"))],
    ids=["f32-adamw", "bf16-adamw", "f32-sgd-clip"])
def test_verls_sft_step_with_ulysses_passes(sp_check, fields):
    res = sp_check(_sp("verl-sft-sp-llama", **fields))
    assert res.verdict == PASS, format_result(res)
    # every stage was judged: the reported loss, the grads, verl's norm, the update
    assert {"loss", "grad", "grad_norm", "param"} <= set(res.worst), set(res.worst)


@pytest.mark.exhaustive("test_mutants kills mutant-verl-sp-grads-not-synced-over-sp at its pinned grads before "
                        "clipping (battery entry train-step, DP 2 x SP 2): its reported loss passed before them")
def test_a_grad_sync_without_the_sp_ranks_fails_at_the_grads(sp_check):
    res = sp_check(_sp("mutant-verl-sp-grads-not-synced-over-sp", steps=1))
    assert res.verdict == FAIL and res.first_check == "grad", format_result(res)
    # the forward is untouched: the reported loss is right, the grads miss the other SP shard
    assert not any(f.kind == "loss" and f.step == 0 for f in res.failures), format_result(res)
    assert any(f.kind == "grad" and f.step == 0 for f in res.failures), format_result(res)


@pytest.mark.exhaustive("the fast tier kills each at its pinned 'reported loss' in test_mutants (battery entry train-step)")
@pytest.mark.parametrize("mutant", ["mutant-verl-sp-dp-size-as-world-size",
                                    "mutant-verl-sp-ranks-see-different-sequences"])
def test_the_sp_count_and_data_bugs_fail_at_the_reported_loss(sp_check, mutant):
    res = sp_check(_sp(mutant))
    assert res.verdict == FAIL and res.first_check == "loss", format_result(res)
    assert any(f.kind == "grad" for f in res.failures), format_result(res)


def test_float64_is_unsupported_before_any_rank_starts(sp_check):
    res = sp_check(_sp("verl-sft-sp-llama", dtype="float64"))
    assert res.verdict == UNSUPPORTED and "fp64" in res.reason, format_result(res)


def test_the_flash_attn_stand_in_is_exact_attention_over_the_packed_segments():
    import torch

    from sp_harness.cases.frameworks.verl.shims import varlen_attention

    gen = torch.Generator().manual_seed(0)
    lengths = (5, 1, 7, 3)
    q = torch.randn(1, sum(lengths), 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, sum(lengths), 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    got = varlen_attention(q, k, v, None, q.shape[1], position_ids=positions, softmax_scale=0.3)
    # each query sees the keys of its own sequence at or before it; query head h reads k/v head h // 2
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(sum(lengths))
    allowed = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = torch.einsum("bhqk,bkhd->bqhd", probs, vv)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
