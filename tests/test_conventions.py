"""The engine's own conventions hold for any correct case (issue 10, item 6): DP input grads,
loss precision whatever the target dtype, the default number of steps, and batches that cover
every shard boundary."""

import os

import torch
from judging import judge

from sp_harness.config.check_config import DEFAULT_STEPS, CheckConfig
from sp_harness.judge.verdict import FAIL, PASS

DDP = os.path.join(os.path.dirname(__file__), "ddp_cases.py")


def test_plain_ddp_with_a_float_input_passes_under_dp(sp_check):
    res = sp_check(CheckConfig(case=f"{DDP}:DDP_MLP", world_size=2, dp=2))
    assert res.verdict == PASS, res.reason
    assert "input_grad" in res.worst  # the input grad was judged, not skipped


def test_a_model_with_in_place_modules_passes(sp_check):
    # the differential trace hooks every module; none of it may make a correct model fail
    res = sp_check(CheckConfig(case=f"{DDP}:DDP_INPLACE", world_size=2, dp=2))
    assert res.verdict == PASS, res.reason


def test_double_averaging_ddp_fails_on_its_param_grads(sp_check):
    res = sp_check(CheckConfig(case=f"{DDP}:DDP_DOUBLE_AVERAGE", world_size=2, dp=2))
    assert res.verdict == FAIL
    assert res.failures[0].kind in ("loss", "input_grad", "grad")
    assert any(f.kind == "grad" for f in res.failures)


def test_loss_bound_scales_with_the_run_precision_not_the_target_dtype():
    # a float32 run whose same-precision loss came out in float64 (a float64 target promoted
    # it): the bound must still be a float32 one (scaled by eps32/eps32 = 1), not eps32/eps64
    ref64 = torch.tensor(2.0, dtype=torch.float64)
    ref_lp = torch.tensor(2.0 + 1e-12, dtype=torch.float64)
    got = torch.tensor(2.0 + 1e-3, dtype=torch.float64)
    chk = judge(kind="loss", name="loss", step=0, rank=0, got=got, ref64=ref64, ref_lp=ref_lp,
                       dtype=torch.float32)
    assert not chk.ok and chk.allowed < 1e-4


def test_a_bug_first_visible_at_step_3_is_caught_by_default(sp_check):
    assert DEFAULT_STEPS >= 3
    res = sp_check(CheckConfig(case="mutant-sp-norm-sync-lost-at-step-3", world_size=2))
    assert res.verdict == FAIL
    assert res.failures[0].step == 2 and res.failures[0].kind == "grad"
    twin = sp_check(CheckConfig(case="megatron-gpt-sp", world_size=2))
    assert twin.verdict == PASS, twin.reason


def test_gpt_batches_separate_neighbouring_tokens_at_every_position():
    from sp_harness.cases.common import gpt_batch

    for vocab in (2, 3, 64):
        cfg = CheckConfig(case="megatron-gpt-sp", seq_len=33, vocab=vocab, batch=4, dp=2, world_size=2)
        for step in range(3):
            tokens, targets = gpt_batch(cfg, step, torch.Generator().manual_seed(step))
            assert (tokens[:, 1:] != tokens[:, :-1]).all()
            assert (targets[:, 1:] != targets[:, :-1]).all()
            assert tokens.min() >= 0 and tokens.max() < vocab


def test_explicit_shards_fix_the_sequence_length_before_case_defaults():
    # the README's own example: 4/4/2 is 10 tokens, whatever the case's default seq_len (12)
    from sp_harness.checks.side_by_side import resolve

    cfg = resolve(CheckConfig(case="megatron-gpt-sp", world_size=3, seq_shards=(4, 4, 2)))
    assert cfg.seq_len == 10


def test_non_finite_timeouts_and_rates_are_usage_errors():
    import math

    import pytest

    for bad in (dict(timeout_s=math.nan), dict(timeout_s=math.inf), dict(lr=math.nan), dict(lr=0.0)):
        with pytest.raises(ValueError, match="finite"):
            CheckConfig(case="seed-mlp", **bad)


def test_a_closed_pipe_ends_the_cli_quietly():
    import subprocess
    import sys

    proc = subprocess.run(f"{sys.executable} -m sp_harness.cli list | head -n 1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.count("\n") == 1
    assert "Traceback" not in proc.stderr
