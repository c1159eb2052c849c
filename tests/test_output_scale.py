"""The coherent scale of a forward output piece (sp_harness.compare.output_scale): its
token-clustered standard error against Monte Carlo draws of the error models it must cover, its
false-alarm rate and power under them, and how it finds a piece's tokens. Pure: no process group."""

import pytest
import torch

from sp_harness.compare.grad_scale import SCALAR_ROUNDINGS
from sp_harness.compare.output_scale import MIN_TOKENS, output_scale_bound, token_rows, token_scale

U = torch.finfo(torch.bfloat16).eps / 2


def _logits(tokens: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """(tokens, width) outputs with a direction every token shares (a logits piece's bias) and
    tokens of unequal norms."""
    shared = torch.randn(width, generator=gen, dtype=torch.float64)
    y = torch.randn(tokens, width, generator=gen, dtype=torch.float64) + shared
    return y * torch.rand(tokens, 1, generator=gen, dtype=torch.float64).add(0.5)


def _errors(y: torch.Tensor, model: str, gen: torch.Generator, draws: int, rel: float = U) -> torch.Tensor:
    """`draws` errors of `y` (draws, T, V) under one model: each element off by its own relative
    error, each token by one factor, both at once, or absolute noise of the piece's rms size."""
    z = torch.randn(draws, *y.shape, generator=gen, dtype=torch.float64)
    per_token = torch.randn(draws, y.shape[0], 1, generator=gen, dtype=torch.float64)
    if model == "elementwise":
        return rel * y * z
    if model == "per_token":
        return rel * y * per_token
    if model == "mixed":
        return rel * y * (z + per_token)
    assert model == "absolute"
    return rel * float(y.square().mean().sqrt()) * z


@pytest.mark.parametrize("model", ["elementwise", "per_token", "mixed", "absolute"])
def test_the_token_clustered_standard_error_matches_the_spread_of_beta(model):
    """Over 2000 draws, the mean estimated variance of beta is within 20% of beta's measured
    variance, whatever the errors' covariance within a token."""
    gen = torch.Generator().manual_seed(1)
    y = _logits(24, 40, gen)
    scales = [token_scale(e, y, 24) for e in _errors(y, model, gen, 2000)]
    betas = torch.tensor([s.beta for s, _ in scales])
    est = sum(s.se ** 2 for s, _ in scales) / len(scales)
    assert abs(est / float(betas.var()) - 1) < 0.2, (est, float(betas.var()))


@pytest.mark.parametrize("model", ["elementwise", "per_token", "mixed"])
def test_correct_runs_stay_inside_the_band_and_a_scaled_one_does_not(model):
    """The run and two members from the same error model: none of 1000 runs leaves the band (the
    quantile is 1e-5); 99% of the runs scaled by SCALAR_ROUNDINGS u plus 16 standard errors do (the band
    reaches MISMATCH x the members' mean plus t(nu) x the combined standard error, about 10 of the
    run's at nu ~ 20)."""
    gen = torch.Generator().manual_seed(2)
    y = _logits(24, 40, gen)
    errs = _errors(y, model, gen, 3000)
    inside, caught = 0, 0
    for i in range(1000):
        members = [errs[1000 + i], errs[2000 + i]]
        bound = output_scale_bound(err=errs[i], member_errs=members, out=y, tokens=24, dtype=torch.bfloat16)
        inside += bound.ratio <= 1
        d = SCALAR_ROUNDINGS * U + 16 * bound.run.se
        scaled = output_scale_bound(err=errs[i] + d * y, member_errs=members, out=y, tokens=24, dtype=torch.bfloat16)
        caught += scaled.ratio > 1
    assert inside == 1000
    assert caught >= 990


def test_members_that_share_a_bias_widen_the_band_toward_it():
    """A coherent error the members make too (a normaliser rounded the same way) is legal up to
    MISMATCH times theirs; a run at that bias passes, the same bias of the opposite sign does not."""
    gen = torch.Generator().manual_seed(3)
    y = _logits(32, 40, gen)
    errs = _errors(y, "elementwise", gen, 3)
    bias = 0.02
    members = [errs[1] + bias * y, errs[2] + bias * y]
    assert output_scale_bound(err=errs[0] + bias * y, member_errs=members, out=y, tokens=32,
                              dtype=torch.bfloat16).ratio <= 1
    assert output_scale_bound(err=errs[0] - bias * y, member_errs=members, out=y, tokens=32,
                              dtype=torch.bfloat16).ratio > 1


@pytest.mark.parametrize("shape,tokens,rows", [((2, 12, 40), 24, (24, 40)), ((12, 2, 40), 24, (24, 40)),
                                               ((2, 12, 4, 8), 24, (24, 32)), ((24, 40), 24, (24, 40)),
                                               ((2, 12, 40), 12, None), ((2, 12, 40), 480, None)])
def test_a_pieces_tokens_are_its_leading_dims_that_multiply_to_the_token_count(shape, tokens, rows):
    out = token_rows(torch.zeros(shape), tokens)
    assert (out is None) if rows is None else tuple(out.shape) == rows


def test_too_few_tokens_or_no_members_are_not_judged():
    """A piece behind fewer than MIN_TOKENS effective tokens, or one token holding nearly all of
    its norm, has no spread to estimate a standard error from; a run without members has no band."""
    gen = torch.Generator().manual_seed(4)
    few = int(MIN_TOKENS) - 1
    y = _logits(few, 40, gen)
    assert token_scale(0.01 * y, y, few) is None
    y = _logits(24, 40, gen)
    y[0] *= 100
    assert token_scale(0.01 * y, y, 24) is None
    assert output_scale_bound(err=0.01 * y, member_errs=[], out=y, tokens=24, dtype=torch.bfloat16) is None


def test_check_tensor_judges_a_forward_pieces_scale_where_it_has_an_ensemble():
    """A bfloat16 forward piece 3% off along its output fails on its scale alone (norm-wise it is
    inside); a float32 one, judged without an ensemble, is not judged this way (its correct runs
    carry coherent errors shared across tokens that the model does not have)."""
    from judging import judge

    gen = torch.Generator().manual_seed(5)
    y = _logits(48, 64, gen)
    errs = _errors(y, "elementwise", gen, 3, rel=0.02)
    kwargs = dict(kind="forward", name="output", step=0, rank=0, ref64=y, ref_lp=y + errs[1], dof=48)
    chk = judge(got=y + errs[0] + 0.03 * y, dtype=torch.bfloat16, ref_samples=[y + errs[2]], **kwargs)
    assert not chk.ok and chk.norm_ratio <= 1 < chk.scale_ratio and abs(chk.scale - 0.03) < 0.01, chk.describe()
    assert judge(got=y + errs[0], dtype=torch.bfloat16, ref_samples=[y + errs[2]], **kwargs).ok
    float32 = judge(got=y + errs[0] + 0.03 * y, dtype=torch.float32, ref_alt=y + errs[2], **kwargs)
    assert float32.scale_ratio == 0
