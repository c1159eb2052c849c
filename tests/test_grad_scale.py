"""The coherent grad scale (sp_harness.compare.grad_scale): its share of the noise along the
exact grad against Monte Carlo draws of the noise model it assumes, its false-alarm rate and
power under that model, and the reference side's derivation of it. Pure: no process group."""

import math

import mpmath
import pytest
import torch
from judging import judge

from sp_harness.compare.dof import weight_grad_dof
from sp_harness.compare.grad_scale import (
    SCALAR_ROUNDINGS,
    T_QUANTILE,
    PieceNoise,
    bias_share,
    grad_scale,
    grad_scale_bound,
    norm_weight_share,
    sums_to_zero,
    t_quantile,
    weight_share,
    weight_shares,
)


def _terms(tokens: int, width_in: int, width_out: int, gen: torch.Generator, *,
           shared: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token Linear inputs x (T, in) and output grads g (T, out); `shared` adds a direction
    every token's input has (a LayerNorm output's)."""
    x = torch.randn(tokens, width_in, generator=gen, dtype=torch.float64) + shared
    g = torch.randn(tokens, width_out, generator=gen, dtype=torch.float64)
    return x, g


def _errors(x: torch.Tensor, g: torch.Tensor, rel: float, gen: torch.Generator, draws: int, *,
            per_token: bool = False) -> torch.Tensor:
    """`draws` errors of the weight grad sum_t g_t x_t^T under the model: every element of each
    token's x and g off by an independent relative error of `rel` rms, or (`per_token`) each
    token's x and g by one factor. (draws, out, in)"""
    shape = (draws, x.shape[0], 1) if per_token else None
    dx = rel * x * torch.randn(shape or (draws, *x.shape), generator=gen, dtype=torch.float64)
    dg = rel * g * torch.randn(shape or (draws, *g.shape), generator=gen, dtype=torch.float64)
    return torch.einsum("dto,ti->doi", dg, x) + torch.einsum("to,dti->doi", g, dx)


def _gpt_pass(seed: int, norm_weight: bool = False):
    """A one-layer float64 reference GPT's forward and backward on 24 tokens with its terms
    recorded: (terms, inputs, output grads, param grads). `norm_weight`: its first norm's weight
    drawn away from ones first (x^ is read back through it)."""
    from sp_harness.reference.gpt import GPT, GPTConfig
    from sp_harness.step.reference import LinearTerms

    torch.manual_seed(seed)
    model = GPT(GPTConfig(hidden=32, ffn=64, num_layers=1)).double()
    if norm_weight:
        with torch.no_grad():
            model.blocks[0].norm1.weight.uniform_(0.5, 1.5)
    terms = LinearTerms(model)
    with terms:
        out = model(torch.randint(0, 64, (2, 12)))
        torch.nn.functional.cross_entropy(out.reshape(-1, 64), torch.randint(0, 64, (24,))).backward()
    inputs, out_grads = terms.terms()
    return terms, inputs, out_grads, {n: p.grad for n, p in model.named_parameters()}


def _trace(x: torch.Tensor, g: torch.Tensor) -> float:
    return 2.0 * float((g.square().sum(1) * x.square().sum(1)).sum())


def _share(x: torch.Tensor, g: torch.Tensor) -> float:
    return weight_share(x, g, g.T @ x, _trace(x, g))


def test_the_t_table_is_students_two_sided_1e5_quantile():
    def tail(nu: float, t: float) -> float:
        return float(mpmath.betainc(nu / 2, 0.5, 0, nu / (nu + t * t), regularized=True))

    for nu, t in T_QUANTILE:
        assert tail(nu, t * 0.995) > 1e-5 > tail(nu, t * 1.005), (nu, t)
    assert t_quantile(24) == T_QUANTILE[5][1] and t_quantile(1e6) < t_quantile(1000)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(shared=3.0)])
def test_each_share_along_the_grad_matches_the_spread_of_its_errors_projection(kw, per_token):
    gen = torch.Generator().manual_seed(31)
    x, g = _terms(24, 32, 48, gen, **kw)
    grad = g.T @ x
    errs = _errors(x, g, 1e-2, gen, 4000, per_token=per_token)
    along = (errs * grad).sum((1, 2)) / grad.square().sum()  # each draw's beta
    measured = float(along.var()) * float(grad.square().sum()) / float(errs.square().sum((1, 2)).mean())
    shares = weight_shares(x, g, grad, _trace(x, g))
    derived = shares[1] if per_token else shares[0]
    assert 0 < derived < 0.5
    assert abs(derived / measured - 1) < 0.15, (kw, per_token, derived, measured)
    assert weight_share(x, g, grad, _trace(x, g)) == max(shares)


@pytest.mark.parametrize("per_token", [False, True])
def test_the_standard_error_from_a_tensors_own_residual_matches_the_spread_of_its_beta(per_token):
    gen = torch.Generator().manual_seed(32)
    x, g = _terms(24, 32, 48, gen, shared=1.0)
    grad, share = g.T @ x, weight_shares(x, g, g.T @ x, _trace(x, g))[int(per_token)]
    scales = [grad_scale(e, grad, share) for e in _errors(x, g, 1e-2, gen, 2000, per_token=per_token)]
    betas = torch.tensor([s.beta for s in scales])
    se = math.sqrt(sum(s.se ** 2 for s in scales) / len(scales))
    assert abs(se / float(betas.std()) - 1) < 0.1, (se, float(betas.std()))


@pytest.mark.parametrize("per_token", [False, True])
def test_correct_runs_stay_inside_the_band_and_a_two_percent_scale_does_not(per_token):
    gen = torch.Generator().manual_seed(33)
    x, g = _terms(24, 32, 64, gen)
    grad = g.T @ x
    noise = PieceNoise(dof=weight_grad_dof(x, g), share=_share(x, g))
    # members and runs: a rounding noise of about 1% of the grad, elementwise or per token
    errs = _errors(x, g, 4e-3 if not per_token else 2e-3, gen, 1500, per_token=per_token)
    bias = 0.004 * grad  # a coherent bias every correct implementation shares (the loss's 1 / tokens)

    def ratio(i: int, d: float) -> float:
        bound = grad_scale_bound(err=errs[i] + bias + d * grad, member_errs=[errs[i + 500] + bias, errs[i + 1000] + bias],
                                 grad=grad, noise=noise, dtype=torch.bfloat16)
        assert bound is not None
        return bound.ratio

    correct = [ratio(i, 0.0) for i in range(500)]
    assert max(correct) < 0.6, max(correct)  # 1e-5 per piece: none of 500 near the edge
    assert min(ratio(i, 0.02) for i in range(100)) > 1
    assert min(ratio(i, -0.02) for i in range(100)) > 1  # against the bias: only the run's noise


def test_a_scalar_rounding_the_members_do_not_share_is_inside_the_band():
    gen = torch.Generator().manual_seed(34)
    x, g = _terms(512, 64, 64, gen)  # many tokens: the band is nearly its edge alone
    grad = g.T @ x
    noise = PieceNoise(dof=weight_grad_dof(x, g), share=_share(x, g))
    errs = _errors(x, g, 4e-3, gen, 3)
    u = torch.finfo(torch.bfloat16).eps / 2
    members = [errs[1], errs[2]]
    at_edge = grad_scale_bound(err=errs[0] - SCALAR_ROUNDINGS * u * grad, member_errs=members, grad=grad, noise=noise,
                               dtype=torch.bfloat16)
    past = grad_scale_bound(err=errs[0] - 3 * SCALAR_ROUNDINGS * u * grad, member_errs=members, grad=grad,
                            noise=noise, dtype=torch.bfloat16)
    assert at_edge is not None and past is not None
    assert at_edge.ratio < 1 < past.ratio, (at_edge.ratio, past.ratio)


def test_check_tensor_records_a_linear_grads_scale_when_the_reference_sent_its_share():
    gen = torch.Generator().manual_seed(35)
    x, g = _terms(24, 32, 64, gen)
    grad = g.T @ x
    noise = PieceNoise(dof=weight_grad_dof(x, g), share=_share(x, g))
    errs = _errors(x, g, 1e-2, gen, 3)  # 1.4% of the grad's norm
    common = dict(kind="grad", name="fc1.weight", step=0, rank=0, ref64=grad, dtype=torch.bfloat16, dof=24,
                  ref_lp=grad + errs[1], ref_samples=[grad + errs[2]])
    scaled = (grad + errs[0]) * 1.03
    assert judge(got=scaled, grad_dof=noise.dof, **common).ok  # the norm-wise bound alone passes it
    recorded = judge(got=scaled, grad_noise=noise, **common)
    assert recorded.ok and recorded.scale_ratio > 1 > recorded.norm_ratio  # recorded, not judged
    fine = judge(got=grad + errs[0], grad_noise=noise, **common)
    assert fine.ok and 0 < fine.scale_ratio < 1


def test_a_piece_whose_noise_lies_along_its_grad_is_not_judged_by_its_scale():
    grad = torch.ones(4, 4, dtype=torch.float64)
    noise = PieceNoise(dof=1.0, share=bias_share(torch.ones(1), torch.ones(1)))
    assert noise.share == 1.0
    assert grad_scale_bound(err=0.1 * grad, member_errs=[0.01 * grad], grad=grad, noise=noise,
                            dtype=torch.bfloat16) is None


def test_the_float64_reference_derives_each_pieces_share_from_its_own_terms_and_grad():
    from sp_harness.checks.references import LinearPiece, piece_noise

    terms, inputs, out_grads, grads = _gpt_pass(36)
    x, g = inputs["blocks.0.mlp.fc1"], out_grads["blocks.0.mlp.fc1"]
    rows = torch.arange(32, 64)
    noise = piece_noise(terms, [LinearPiece(rank=1, name="blocks.0.mlp.fc1.weight", rows=rows, cols=torch.arange(32)),
                                LinearPiece(rank=1, name="blocks.0.mlp.fc1.bias", rows=rows, cols=None)], grads)
    weight = grads["blocks.0.mlp.fc1.weight"][32:]
    assert torch.allclose(weight, g[:, 32:].T @ x)  # the grad is the terms' sum: one G for both
    assert noise[(1, "blocks.0.mlp.fc1.weight")].share == pytest.approx(_share(x, g[:, 32:]), rel=1e-9)
    assert noise[(1, "blocks.0.mlp.fc1.bias")].share == pytest.approx(
        bias_share(g[:, 32:].square().sum(0), grads["blocks.0.mlp.fc1.bias"][32:], g[:, 32:]), rel=1e-9)


def test_a_norm_weights_share_matches_the_spread_of_its_errors_projection():
    gen = torch.Generator().manual_seed(37)
    dy = torch.randn(48, 64, generator=gen, dtype=torch.float64)
    xhat = torch.randn(48, 64, generator=gen, dtype=torch.float64) + 1.0  # a common offset: terms alike
    grad = (dy * xhat).sum(0)
    w = dy * xhat
    shares = []
    for per_token in (False, True):
        shape = (4000, 48, 1) if per_token else (4000, 48, 64)
        errs = (1e-2 * w * (torch.randn(shape, generator=gen, dtype=torch.float64)
                            + torch.randn(shape, generator=gen, dtype=torch.float64))).sum(1)  # dy's and x^'s
        along = errs @ grad / grad.square().sum()
        shares.append(float(along.var()) * float(grad.square().sum()) / float(errs.square().sum(1).mean()))
    derived = norm_weight_share(dy, xhat, grad)
    assert abs(derived / max(shares) - 1) < 0.15, (derived, shares)


def test_the_float64_reference_derives_a_norm_weights_noise_from_its_normalised_inputs():
    from sp_harness.checks.references import LinearPiece, piece_noise

    terms, inputs, out_grads, grads = _gpt_pass(38, norm_weight=True)
    name = "blocks.0.norm1"
    assert name in terms.norms
    # the recorded x^ and dy give back the weight grad autograd computed
    assert torch.allclose((out_grads[name] * inputs[name]).sum(0), grads[name + ".weight"])
    pieces = [LinearPiece(rank=0, name=name + suffix, rows=torch.arange(32), cols=None) for suffix in (".weight", ".bias")]
    noise = piece_noise(terms, pieces, grads)
    piece = noise[(0, name + ".weight")]
    assert piece.share == pytest.approx(norm_weight_share(out_grads[name], inputs[name], grads[name + ".weight"]))
    # never more than the quarter of the tokens they replace: a norm bias's 32 elements alone
    # count about as many (a bfloat16 campaign draw false-alarmed at 1.15x with 78 of 104 tokens)
    assert 1 <= piece.dof <= 24 * 0.25
    assert 1 <= noise[(0, name + ".bias")].dof <= 24 * 0.25


def test_a_softmaxs_key_projection_is_told_apart_by_its_output_grads_summing_to_zero():
    _, _, out_grads, grads = _gpt_pass(39)
    verdicts = {name: sums_to_zero(out_grads[f"blocks.0.{name}"], grads[f"blocks.0.{name}.weight"])
                for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    assert verdicts == {"attn.q_proj": False, "attn.k_proj": True, "attn.v_proj": False, "attn.out_proj": False,
                        "mlp.fc1": False, "mlp.fc2": False}
    # a rank holding none of a layer's rows (ffn 1 over 2 TP ranks: found by tests/test_properties.py)
    assert not sums_to_zero(out_grads["blocks.0.mlp.fc1"][:, :0], grads["blocks.0.mlp.fc1.weight"][:0])
