"""The tolerance model's parts, pure and process-group free: the optimizer-stage reference and
its bound, the reorder adversary, the norm-wise criterion's gates."""

import torch

from sp_harness.compare.tolerance import NORM_MIN_DOF, check_bounded, check_tensor
from sp_harness.step.adversary import ReorderAdversary, order_error, round_tf32
from sp_harness.step.optim_ref import OptimState, make_optimizer, reference_step, state_of


def _adamw_steps(dtype, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(40, 7, generator=gen, dtype=torch.float64).to(dtype))
    opt = make_optimizer("adamw", 1e-2, [p])
    out = []
    for _ in range(steps):
        p.grad = (torch.randn(40, 7, generator=gen, dtype=torch.float64) * 1e-3).to(dtype)
        before, state = p.detach().clone(), state_of(opt, p, lambda t: t)
        ref = reference_step(optimizer="adamw", lr=1e-2, param=before, grad=p.grad, state=state, dtype=dtype)
        opt.step()
        out.append((p.detach().clone(), ref))
    return out


def test_adamw_reference_matches_torch_within_its_bound_in_every_dtype():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for got, ref in _adamw_steps(dtype):
            chk = check_bounded(kind="param", name="p", step=0, rank=0, got=got, want=ref.param, bound=ref.bound)
            assert chk.ok, (dtype, chk.describe())


def test_adamw_bound_catches_a_scaled_update():
    steps = _adamw_steps(torch.float32)
    (before, _), (got, ref) = steps[0], steps[1]
    scaled = before.double() + 1.01 * (got.double() - before.double())  # the update 1% larger
    chk = check_bounded(kind="param", name="p", step=1, rank=0, got=scaled, want=ref.param, bound=ref.bound)
    assert not chk.ok


def test_sgd_reference_matches_torch():
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=torch.float32))
    opt = make_optimizer("sgd", 0.1, [p])
    for _ in range(3):
        p.grad = torch.randn(5, 3, generator=gen)
        ref = reference_step(optimizer="sgd", lr=0.1, param=p.detach().clone(), grad=p.grad,
                             state=state_of(opt, p, lambda t: t), dtype=torch.float32)
        opt.step()
        assert check_bounded(kind="param", name="p", step=0, rank=0, got=p, want=ref.param, bound=ref.bound).ok


def test_fresh_state_is_empty():
    assert reference_step(optimizer="adamw", lr=1e-2, param=torch.ones(2), grad=None, state=OptimState(),
                          dtype=torch.float32).param.tolist() == [1.0, 1.0]


def test_adversary_changes_the_last_bits_only_and_is_deterministic_in_its_inputs():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 300, generator=gen), torch.randn(300, 8, generator=gen)
    exact = a.double() @ b.double()
    native = a @ b
    mode = ReorderAdversary(seed=3)
    with mode:
        first = a @ b
        again = a @ b
    assert mode.num_rewritten == 2
    assert torch.equal(first, again)  # same inputs, same bits: replicated grads stay identical
    assert not torch.equal(first, native)
    bound = 300 * torch.finfo(torch.float32).eps * (a.abs().double() @ b.abs().double())  # gamma_K |A||B|
    assert ((first.double() - exact).abs() <= bound).all()


def test_order_error_scales_with_the_magnitudes_not_the_result():
    a = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    err = order_error(a, b, torch.mm, torch.Generator().manual_seed(0), 0.5)
    assert err.abs().item() > 0  # a - a is exactly 0, yet another order may leave a rounding


def test_tf32_rounding_keeps_ten_mantissa_bits():
    x = torch.tensor([1.0 + 2.0 ** -11, 1.0 + 2.0 ** -9], dtype=torch.float32)
    assert round_tf32(x).tolist() == [1.0 + 2.0 ** -10, 1.0 + 2.0 ** -9]


def test_norm_wise_bound_needs_enough_tokens_behind_the_tensor():
    gen = torch.Generator().manual_seed(0)
    ref64 = torch.randn(32, 32, generator=gen, dtype=torch.float64)
    ref_lp = ref64 * (1 + 1e-7 * torch.randn(32, 32, generator=gen, dtype=torch.float64))
    got = ref64 * (1 + 4e-6)  # systematic: every element 4e-6 high, within the max-abs bound
    few = check_tensor(kind="grad", name="w", step=0, rank=0, got=got, ref64=ref64, ref_lp=ref_lp,
                       dtype=torch.float32, dof=NORM_MIN_DOF - 1)
    many = check_tensor(kind="grad", name="w", step=0, rank=0, got=got, ref64=ref64, ref_lp=ref_lp,
                        dtype=torch.float32, dof=NORM_MIN_DOF)
    assert few.ok and few.norm_ratio == 0
    assert not many.ok and many.norm_ratio > 1 and many.max_abs <= many.allowed
