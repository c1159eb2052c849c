"""The float64 shadow optimizer (sp_harness.step.shadow) that judges a training step whose
optimizer state cannot be read: a correct run with float32 master weights stays inside its
carried bound over many clipped steps, for params in float32 and bfloat16; a run whose optimizer
differs in one hyper-parameter, or that keeps no master copy, leaves it."""

import os

import pytest
import torch

from sp_harness.checks import train_step
from sp_harness.config.check_config import CheckConfig
from sp_harness.report.result_text import format_result
from sp_harness.step.optim_ref import make_optimizer
from sp_harness.step.shadow import ShadowOptimizer

STEPS = 40


def _run(optimizer: str, param_dtype: torch.dtype, *, lr: float = 1e-2, seed: int = 0, lr_run: float | None = None,
         masters: bool = True) -> float:
    """The worst |param - shadow| / bound over STEPS clipped steps of a run that keeps float32
    master weights (as megatron's and DeepSpeed's mixed-precision optimizers do)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (64, 33)
    param = (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.2).to(param_dtype)
    master = torch.nn.Parameter(param.to(torch.float32))
    opt = make_optimizer(optimizer, lr if lr_run is None else lr_run, [master])
    shadow = ShadowOptimizer(optimizer=optimizer, lr=lr, master_dtype=torch.float32, param_dtype=param_dtype)
    worst = 0.0
    for _ in range(STEPS):
        # grads with mixed magnitudes (some far below the rest, some zero) and a clip coefficient < 1
        grad = (torch.randn(shape, generator=gen, dtype=torch.float64)
                * torch.logspace(-4, 0, shape[1], dtype=torch.float64)).to(param_dtype)
        grad[0] = 0
        coef = float(torch.rand((), generator=gen, dtype=torch.float64)) * 0.9 + 0.05
        expected = shadow.expect(0, param, grad, coef=coef, coef_err=0.0)
        if not masters:  # the optimizer steps the low-precision param itself
            master.data.copy_(param.to(torch.float32))
        master.grad = grad.to(torch.float32) * torch.tensor(coef, dtype=torch.float32)
        opt.step()
        param = master.detach().to(param_dtype)
        err = (param.to(torch.float64) - expected.param).abs()
        worst = max(worst, float((err / expected.bound.clamp(min=1e-300)).max()))
    return worst


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_correct_run_stays_within_the_carried_bound(optimizer, dtype, seed):
    assert _run(optimizer, dtype, seed=seed) <= 1.0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_run_with_another_lr_leaves_it(optimizer, dtype):
    assert _run(optimizer, dtype, lr_run=1e-2 * 1.05) > 1.0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_bf16_run_without_master_weights_leaves_it(optimizer):
    # updates below half a bfloat16 ulp are lost without a float32 master, and the loss compounds
    assert _run(optimizer, torch.bfloat16, lr=1e-3, masters=False) > 1.0


MASTER_CASES = os.path.join(os.path.dirname(__file__), "master_weight_cases.py")


@pytest.mark.parametrize("fields", [dict(dtype="float32", optimizer="sgd", clip_grad_norm=0.01),
                                    dict(dtype="bfloat16", optimizer="adamw", clip_grad_norm=0.01)])
def test_a_step_with_master_weights_passes_through_the_shadow(sp_pool, fields):
    res = train_step.check(CheckConfig(case=f"{MASTER_CASES}:MASTERS", world_size=2, train_step=True, micro_batches=3,
                                       steps=3, **fields), sp_pool)
    assert res.verdict == "PASS", format_result(res)
    assert "param" in res.worst


def test_a_step_with_another_lr_fails_at_the_update(sp_pool):

    res = train_step.check(CheckConfig(case=f"{MASTER_CASES}:LR_OFF", world_size=2, train_step=True, micro_batches=3,
                                       steps=1, dtype="float32", optimizer="adamw"), sp_pool)
    assert res.verdict == "FAIL" and res.first_check == "param", res.reason
