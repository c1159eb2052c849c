"""The ensemble bound (sp_harness.compare.tolerance: ENSEMBLE_KINDS, ensemble_factor), the
'rounded' ensemble member (sp_harness.step.rounding.RoundedResults) and localisation's words
for a forward failure no module explains (sp_harness.compare.divergence). Pure: no process
group."""

import dataclasses

import pytest
import torch
from judging import judge

from sp_harness.capture.trace import Trace
from sp_harness.compare import tolerance
from sp_harness.compare.divergence import first_divergence
from sp_harness.compare.dof import bias_grad_dof, member_dof, weight_grad_dof
from sp_harness.compare.tolerance import (
    ALT_OVERESTIMATE,
    CHI_RATIO_QUANTILE,
    MISMATCH,
    NORM_FACTOR,
    ensemble_factor,
)
from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import RankResult, merge, record
from sp_harness.step import precision
from sp_harness.step.rounding import RoundedResults


def _bf16_like(ref64: torch.Tensor, gen: torch.Generator, rel: float) -> torch.Tensor:
    """ref64 with a rounding-sized random relative error of `rel` rms."""
    return ref64 * (1 + rel * torch.randn(ref64.shape, generator=gen, dtype=torch.float64))


def test_factor_follows_the_chi_ratio_table_and_falls_with_more_tokens():
    assert ensemble_factor(0.5) == ensemble_factor(1) == MISMATCH * CHI_RATIO_QUANTILE[0][1]
    # one degree of freedom is a single half-normal sample against the larger of two: the
    # small-piece quantile's first row, not the two-degree one
    assert CHI_RATIO_QUANTILE[0] == tolerance.SMALL_PIECE_QUANTILE[0]
    assert ensemble_factor(10_000) == MISMATCH * CHI_RATIO_QUANTILE[-1][1]
    values = [ensemble_factor(m) for m in (1, 1.5, 2, 3, 5, 8, 12, 16, 24, 32, 100, 256, 512)]
    assert values == sorted(values, reverse=True)


def test_ensemble_catches_a_3_percent_scaled_bf16_piece_the_two_reference_bound_passes():
    gen = torch.Generator().manual_seed(0)
    ref64 = torch.randn(48, 64, generator=gen, dtype=torch.float64)
    ref_lp, sample = _bf16_like(ref64, gen, 4e-3), _bf16_like(ref64, gen, 4e-3)
    alt = _bf16_like(ref64, gen, 1.2e-2)  # the perturbed reference: about 3x a real kernel's error
    correct = _bf16_like(ref64, gen, 4e-3)
    scaled = correct * 1.03
    common = dict(kind="forward", name="output", step=0, rank=0, ref64=ref64, ref_lp=ref_lp, ref_alt=alt,
                  dtype=torch.bfloat16, dof=48)
    assert judge(got=correct, ref_samples=[sample], **common).ok
    assert not judge(got=scaled, ref_samples=[sample], **common).ok
    # without the ensemble (a float64 run's path, or no samples) the same piece passes
    assert judge(got=scaled, **common).ok


def test_grads_and_input_grads_are_judged_by_the_ensemble_too():
    gen = torch.Generator().manual_seed(1)
    ref64 = torch.randn(48, 64, generator=gen, dtype=torch.float64)
    ref_lp, sample = _bf16_like(ref64, gen, 4e-3), _bf16_like(ref64, gen, 4e-3)
    alt = _bf16_like(ref64, gen, 1.2e-2)
    correct = _bf16_like(ref64, gen, 4e-3)
    for kind in ("grad", "input_grad"):
        common = dict(kind=kind, name="w", step=0, rank=0, ref64=ref64, ref_lp=ref_lp, ref_alt=alt,
                      dtype=torch.bfloat16, dof=48, ref_samples=[sample])
        assert judge(got=correct, **common).ok
        chk = judge(got=correct * 1.03, **common)
        assert not chk.ok and chk.noise_norm < 2 * float((ref_lp - ref64).norm())  # the ensemble's, not alt's
        assert NORM_FACTOR * float((alt - ref64).norm()) > chk.err_norm  # the old bound passed it


def test_a_grad_whose_perturbed_reference_errs_far_more_keeps_a_third_of_it():
    # a cancelling sum (a norm's bias grad): alt, rounding every op's inputs, errs 12x the
    # members; a correct sharded run splitting the sum by its shards errs 3.6x them
    gen = torch.Generator().manual_seed(7)
    ref64 = torch.randn(48, 64, generator=gen, dtype=torch.float64)
    ref_lp, sample = _bf16_like(ref64, gen, 4e-3), _bf16_like(ref64, gen, 4e-3)
    alt, got = _bf16_like(ref64, gen, 4.8e-2), _bf16_like(ref64, gen, 1.45e-2)
    common = dict(name="b", step=0, rank=0, got=got, ref64=ref64, ref_lp=ref_lp, ref_alt=alt, dtype=torch.bfloat16,
                  dof=48, ref_samples=[sample])
    grad = judge(kind="grad", **common)
    assert grad.ok and abs(grad.noise_norm - float((alt - ref64).norm()) / ALT_OVERESTIMATE) < 1e-12
    assert not judge(kind="forward", **common).ok  # a forward output has no such sum


def test_a_forward_error_from_a_few_tokens_counts_those_tokens_not_all():
    # 128 tokens, but every member's error sits on 3 of them (a LayerNorm whose variance cancels
    # there): the sharded run's error norm is a chi ratio of 3 degrees of freedom, not 128
    gen = torch.Generator().manual_seed(8)
    ref64 = torch.randn(128, 12, generator=gen, dtype=torch.float64)

    def few_tokens(rel: float) -> torch.Tensor:
        err = torch.zeros_like(ref64)
        err[[5, 40, 99]] = rel * torch.randn(3, 12, generator=gen, dtype=torch.float64)
        return ref64 + err

    common = dict(kind="forward", name="output", step=0, rank=0, ref64=ref64, dtype=torch.bfloat16, dof=128)
    got = few_tokens(0.12)
    chk = judge(got=got, ref_lp=few_tokens(0.03), ref_alt=few_tokens(0.1), ref_samples=[few_tokens(0.03)],
                       **common)
    assert chk.ok and chk.err_norm > 3 * chk.noise_norm  # within F(3), beyond F(128) = 1.86
    assert not judge(got=got * 1.3, ref_lp=few_tokens(0.03), ref_alt=few_tokens(0.1),
                            ref_samples=[few_tokens(0.03)], **common).ok


def test_the_rounded_member_forms_softmax_row_sums_from_its_output_as_a_flash_kernel():
    # D = rowsum(dO * O) from the P @ V it rounded and the dO of g's matmul, not softmax's own
    # D = rowsum(p * g); the dO it reads carries a rounding of its own (RoundedResults)
    bf16 = torch.bfloat16
    seed = torch.Generator().manual_seed(5)
    # values and output grads with a common offset: every g_j = dO . v_j is near D, p (g - D)
    # cancels and D's rounding shows; all exact in bf16, so the member rounds no input
    scores, v, w = (torch.randn(6, 32, 32 if i == 0 else 16, generator=seed) + (4 if i else 0) for i in range(3))
    scores, v, w = (t.to(bf16).float() for t in (scores, v, w))

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(bf16).float()

    def score_grad(gen: torch.Generator | None) -> torch.Tensor:
        leaf = scores.clone().requires_grad_()
        with RoundedResults(bf16, gen):
            (torch.bmm(leaf.softmax(-1), v) * w).sum().backward()
        return leaf.grad

    prob = rounded(scores.softmax(-1))  # (B, S, S)
    out = rounded(torch.bmm(prob, v))  # (B, S, d)
    g = rounded(torch.bmm(w, v.transpose(1, 2)))  # (B, S, S)
    u = torch.finfo(bf16).eps / 2
    drawn = torch.rand(w.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).float()
    rowsum = (w * (1 + u * (2 * drawn - 1)) * out).sum(-1, keepdim=True)  # (B, S, 1)
    flash = rounded(prob * (g - rowsum))
    ulp = torch.finfo(bf16).eps * flash.abs().max()
    assert float((score_grad(torch.Generator().manual_seed(6)) - flash).abs().max()) <= float(ulp)
    assert float((score_grad(None) - flash).abs().max()) > 2 * float(ulp)


def test_a_cancelling_piece_whose_max_abs_bound_binds_is_judged():
    # the members err by more than half the piece's norm (its norm-wise bound would pass a zero
    # tensor), but one large element keeps the max-abs bound below it: judged
    gen = torch.Generator().manual_seed(2)
    ref64 = torch.zeros(64, 64, dtype=torch.float64)
    ref64[0, 0] = 1.0
    noise = 0.012 * torch.randn(64, 64, generator=gen, dtype=torch.float64)
    common = dict(kind="forward", name="output", step=0, rank=0, ref64=ref64, ref_lp=ref64 + noise.flip(0),
                  ref_alt=ref64 + noise, dtype=torch.bfloat16, dof=32, ref_samples=[ref64 - noise])
    assert float(noise.norm()) >= tolerance.CANCELLATION * float(ref64.norm())
    chk = judge(got=ref64 + noise.flip(1), **common)
    assert chk.ok and not chk.vacuous and chk.allowed < 1
    wrong = ref64.clone()
    wrong[0, 0] = 0.0
    assert not judge(got=wrong + noise.flip(1), **common).ok


def _vacuous_grad(dtype):
    """A bfloat16 grad piece whose correct references err by about its own norm (the sixteenth
    session's hidden-4 ulysses-gpt: references about 1x, the correct run 17x)."""
    gen = torch.Generator().manual_seed(31)
    ref64 = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    members = [ref64 + ref64.norm() / 8 * torch.randn(16, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    run = ref64 + 17 * ref64.norm() / 8 * torch.randn(16, 4, generator=gen, dtype=torch.float64)
    return dict(kind="grad", name="pos_emb.weight", step=0, rank=0, ref64=ref64, ref_lp=members[0],
                ref_alt=members[1], dtype=dtype, dof=12, ref_samples=[members[2]] if dtype == torch.bfloat16 else []), run


def test_a_piece_whose_bounds_would_pass_zero_is_not_judged_and_is_named():
    common, run = _vacuous_grad(torch.bfloat16)
    zero = judge(got=torch.zeros_like(common["ref64"]), **common)
    chk = judge(got=run, **common)
    assert zero.ok and chk.ok and chk.ratio == 0 and chk.vacuous >= 1
    assert chk.norm_ratio > 1 or chk.max_abs > chk.allowed  # what the bounds would have said
    # a zero tensor is what the bounds pass (the definition), the run is what they would have failed
    assert chk.withheld_ratio == max(chk.norm_ratio, chk.max_abs / chk.allowed) > 1 >= zero.withheld_ratio > 0
    result = RankResult(rank=0)
    record(result, zero)
    record(result, chk)
    assert result.num_checks == 0 and result.withheld == [zero, chk] and not result.worst


def test_merged_ranks_name_the_first_withheld_piece_and_keep_the_worst_would_be_ratio():
    common, run = _vacuous_grad(torch.bfloat16)
    first = judge(got=torch.zeros_like(common["ref64"]), **common)
    worst = judge(got=run, **{**common, "step": 1, "rank": 1})
    ranks = [RankResult(rank=0), RankResult(rank=1)]
    record(ranks[0], first)
    record(ranks[1], worst)
    res = merge(CheckConfig(case="ulysses-gpt", dtype="bfloat16"), ranks)
    # the first piece is named, the one its bounds would have failed is recorded
    assert res.verdict == "PASS" and [c.step for c in res.vacuous] == [0]
    assert [(c.step, c.rank) for c in res.withheld_worst] == [(1, 1)] and res.withheld_worst[0].withheld_ratio > 1
    assert res.to_json()["withheld_worst"][0]["withheld_ratio"] == worst.withheld_ratio


def test_a_vacuous_piece_still_fails_where_the_run_is_not_finite():
    common, run = _vacuous_grad(torch.bfloat16)
    run[3, 1] = float("nan")
    assert not judge(got=run, **common).ok


def test_float32_judges_the_pieces_bfloat16_withholds():
    common, run = _vacuous_grad(torch.float32)
    chk = judge(got=run, **common)
    assert not chk.ok and not chk.vacuous


def _small_grad(dtype, *, aligned=False):
    """A 32-element norm-weight grad piece (under NORM_MIN_NUMEL) of a bfloat16 run: members err
    about 1% of its norm, the perturbed reference 8% (its worst element, x 16, above the piece's
    largest, as measured in the default configs), and a correct run about as the members;
    `aligned`: every reference errs along one direction (one token's rounding amplified)."""
    gen = torch.Generator().manual_seed(7)
    ref64 = torch.randn(32, generator=gen, dtype=torch.float64)
    direction = torch.randn(32, generator=gen, dtype=torch.float64)

    def err(rel):
        e = direction * torch.randn((), generator=gen, dtype=torch.float64) if aligned else torch.randn(
            32, generator=gen, dtype=torch.float64)
        return rel * float(ref64.norm()) * e / e.norm()

    common = dict(kind="grad", name="blocks.0.norm1.weight", step=0, rank=0, ref64=ref64, ref_lp=ref64 + err(0.01),
                  ref_alt=ref64 + err(0.08), dtype=dtype, dof=24,
                  ref_samples=[ref64 + err(0.01)] if dtype == torch.bfloat16 else [])
    return common, ref64 + err(0.012)


def test_a_small_bf16_piece_has_the_ensembles_norm_wise_bound():
    # a norm or bias grad of 16-32 elements had the max-abs bound alone, 16x the perturbed
    # reference's worst element: vacuous in every default bfloat16 config (docs/tolerance.md)
    common, correct = _small_grad(torch.bfloat16)
    chk = judge(got=correct, **common)
    assert chk.ok and not chk.vacuous and chk.norm_ratio > 0 and chk.dof >= 2
    assert chk.allowed >= float(common["ref64"].abs().max())  # its max-abs bound alone passes zero
    assert not judge(got=torch.zeros_like(correct), **common).ok
    # a replicated norm grad summed over one of two ranks only: about half of it
    assert not judge(got=common["ref64"] * 0.5, **common).ok
    # float32 (no members) keeps the max-abs bound alone there
    common32, correct32 = _small_grad(torch.float32)
    assert judge(got=correct32, **common32).norm_ratio == 0


def test_members_that_err_along_one_direction_count_one_degree_of_freedom():
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(32, generator=gen, dtype=torch.float64)
    assert member_dof([v, -3 * v, 0.5 * v]) == pytest.approx(1.0)
    e1, e2 = torch.zeros(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64)
    e1[0], e2[1] = 1.0, 1.0
    assert member_dof([e1, e2]) == float("inf")  # orthogonal: no evidence of fewer
    # the least over pairs: one aligned pair is enough
    assert member_dof([v, 2 * v, torch.randn(32, generator=gen, dtype=torch.float64)]) == pytest.approx(1.0)
    aligned, run = _small_grad(torch.bfloat16, aligned=True)
    spread, _ = _small_grad(torch.bfloat16)
    assert judge(got=run, **aligned).dof < 1.01 < judge(got=run, **spread).dof


def test_an_exactly_zero_piece_is_judged():
    zero = torch.zeros(8, 8, dtype=torch.float64)
    noisy = torch.full((8, 8), 1e-3, dtype=torch.float64)
    chk = judge(kind="grad", name="pos_emb.weight", step=0, rank=0, got=noisy, ref64=zero, ref_lp=noisy,
                       ref_alt=noisy, dtype=torch.bfloat16, dof=12, ref_samples=[noisy])
    assert not chk.vacuous


def test_rounded_results_round_every_result_to_the_run_dtype():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(8, 16, generator=gen)
    b = torch.randn(16, 4, generator=gen)
    with RoundedResults(torch.bfloat16):
        out = (a @ b).exp()
    assert out.dtype == torch.float32
    assert torch.equal(out, out.to(torch.bfloat16).float())
    exact = (a.double() @ b.double()).exp()
    assert not torch.equal(out.double(), exact)


def test_a_forward_failure_in_a_flat_module_is_not_blamed_on_the_grad_sync():
    empty = Trace(forward={}, backward={})
    d = first_divergence(step=0, rank=1, sharded=empty, ref64=empty, ref_lp=empty, ref_alt=empty,
                         dtype=torch.float64, seq_len=8, seq_shards=(4, 4), tp_rank=1, failed_kind="forward")
    assert d.phase == "unaligned"
    assert "no submodule" in d.note and "grad sync" not in d.describe()


def test_unaligned_modules_are_named_with_why():
    got = Trace(forward={"attn": torch.zeros(2, 3, 5)}, backward={})
    ref = Trace(forward={"attn": torch.zeros(2, 7, 5)}, backward={})
    d = first_divergence(step=0, rank=0, sharded=got, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64,
                         seq_len=8, seq_shards=(4, 4), tp_rank=0, failed_kind="lse",
                         skipped=frozenset({"blocks.0.mlp"}))
    assert d.phase == "unaligned"
    assert "'attn'" in d.note and "(2, 3, 5)" in d.note and "'blocks.0.mlp'" in d.note
    # a param-grad failure with nothing diverging is still the grad sync's
    d = first_divergence(step=0, rank=0, sharded=got, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64,
                         seq_len=8, seq_shards=(4, 4), tp_rank=0, failed_kind="grad")
    assert d.phase == "none"


def test_a_forward_divergence_names_the_uncompared_modules_before_it_and_what_could_cause_it():
    x = torch.ones(4, 3, dtype=torch.float64)
    ref = Trace(forward={"norm": x, "mlp": x}, backward={})
    # 'emb' holds TP-sharded params (not compared) and runs first; 'mlp' and its 'fc' after 'norm'
    got = Trace(forward={"norm": x + 1, "mlp": x}, backward={}, order=["emb", "norm", "mlp", "mlp.fc"])
    d = first_divergence(step=0, rank=0, sharded=got, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64,
                         seq_len=4, seq_shards=(4,), tp_rank=0, failed_kind="forward", skipped=frozenset({"emb"}))
    assert (d.module, d.phase, d.upstream, d.ran_after) == ("norm", "forward", ("emb",), ("mlp", "mlp.fc"))
    assert "where the error may enter instead: emb" in d.describe()
    # an op upstream, in the module itself (through a wrapper's prefix), or in a module the trace
    # never saw may be the cause; one later in the forward, in backward or in the loss cannot
    assert d.could_cause("emb", backward=False) and d.could_cause("module.norm", backward=False)
    assert d.could_cause("Model", backward=False)
    assert not d.could_cause("mlp.fc", backward=False) and not d.could_cause("module.mlp", backward=False)
    assert not d.could_cause("norm", backward=True) and not d.could_cause("loss", backward=False)


def test_float32_forward_takes_the_sharper_of_its_two_reference_ensemble_and_norm_bound_grads_do_not(monkeypatch):
    # 256 tokens of float32 error at 1e-7: the run-precision and perturbed references are the
    # ensemble for a forward piece (F about 1.9 and a half-ulp floor), so a 3e-7 scaling of the
    # piece fails there, where 4 x noise + 2 ulps passes it; a grad keeps the latter (a sharded
    # attention's backward rounds what neither member forms)
    gen = torch.Generator().manual_seed(2)
    ref64 = torch.randn(256, 64, generator=gen, dtype=torch.float64)
    ref_lp, alt, correct = (_bf16_like(ref64, gen, 1e-7) for _ in range(3))
    scaled = correct * (1 + 3e-7)
    common = dict(name="output", step=0, rank=0, ref64=ref64, ref_lp=ref_lp, ref_alt=alt, dtype=torch.float32,
                  dof=256)
    assert precision.FLOAT32.alt_member_kinds == frozenset({"forward", "lse"})
    # without the ensemble, the two-reference bound passes the piece
    monkeypatch.setitem(precision.PRECISIONS, torch.float32,
                        dataclasses.replace(precision.FLOAT32, alt_member_kinds=frozenset()))
    assert judge(kind="forward", got=scaled, **common).ok
    monkeypatch.setitem(precision.PRECISIONS, torch.float32, precision.FLOAT32)
    assert judge(kind="forward", got=correct, **common).ok
    assert not judge(kind="forward", got=scaled, **common).ok
    assert judge(kind="grad", got=scaled, **common).ok
    # few tokens: the two-reference bound is the sharper one and stays
    few = dict(common, dof=8)
    assert judge(kind="forward", got=scaled, **few).ok


def _terms(tokens: int, width_in: int, width_out: int, gen: torch.Generator, *, shared: float = 0.0,
           gated: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token Linear inputs x (T, in) and output grads g (T, out): `shared` adds a direction
    every token's input has (a LayerNorm output's), `gated` keeps g on that many tokens only."""
    x = torch.randn(tokens, width_in, generator=gen, dtype=torch.float64) + shared
    g = torch.randn(tokens, width_out, generator=gen, dtype=torch.float64)
    if gated:
        g[gated:] *= 0.01
    return x, g


def _empirical_dof(x: torch.Tensor, g: torch.Tensor, gen: torch.Generator, draws: int = 4000, *,
                   errs_in: str = "both") -> float:
    """2 mean^2 / var of ||E||^2 over draws of the error weight_grad_dof models: every element of
    each token's x and g (or only one side's: `errs_in` 'x' or 'g') off by an independent relative
    error, E = sum_t dg_t x_t^T + g_t dx_t^T."""
    dx = x * torch.randn(draws, *x.shape, generator=gen, dtype=torch.float64) * (errs_in != "g")
    dg = g * torch.randn(draws, *g.shape, generator=gen, dtype=torch.float64) * (errs_in != "x")
    err = torch.einsum("dto,ti->doi", dg, x) + torch.einsum("to,dti->doi", g, dx)
    sq = err.square().sum((1, 2))
    return float(2 * sq.mean() ** 2 / sq.var())


def test_weight_grad_dof_is_the_spread_of_the_error_norm_it_models():
    # Satterthwaite's (tr C)^2 / tr C^2 of each error term (only g's, only x's) against the
    # measured spread of ||E||^2, the fewer of the two, for tokens that weigh alike, a gated unit
    # (a few tokens carry it), a one-unit piece whose inputs share a direction (the two-unit-MLP
    # near miss: many tokens, few directions), and past the token sample (pairs summed over 128 of
    # 300 tokens and scaled up); with both terms alike the spread has at least as many
    gen = torch.Generator().manual_seed(23)
    for tokens, width_in, width_out, kw in ((24, 8, 4, {}), (60, 12, 3, dict(gated=5)),
                                            (100, 16, 1, dict(shared=3.0)), (300, 6, 2, dict(shared=1.0))):
        x, g = _terms(tokens, width_in, width_out, gen, **kw)
        derived = weight_grad_dof(x, g)
        fewer = min(_empirical_dof(x, g, gen, errs_in="g"), _empirical_dof(x, g, gen, errs_in="x"))
        assert abs(derived / fewer - 1) < 0.2, (tokens, kw, derived, fewer)
        assert derived < 1.2 * _empirical_dof(x, g, gen), (tokens, kw)


def test_a_one_unit_grad_over_shared_inputs_counts_its_directions_not_its_tokens():
    gen = torch.Generator().manual_seed(24)
    x, g = _terms(690, 132, 1, gen, shared=3.0)
    dof = weight_grad_dof(x, g)
    assert dof < 10  # a quarter of the tokens (GRAD_DOF_SHARE) would count 172
    ref64 = (g.T @ x) / 690  # (1, 132)
    noise = 4e-3 * ref64.norm() / ref64.numel() ** 0.5  # 1.3% of the grad: a bf16 grad errs about so

    def member(scale: float) -> torch.Tensor:
        # an error mostly along the shared input direction, as a real one-unit grad's is
        return ref64 + scale * noise * (3 + torch.randn(ref64.shape, generator=gen, dtype=torch.float64))

    got = member(2.8)
    common = dict(kind="grad", name="fc1.weight", step=0, rank=0, ref64=ref64, dtype=torch.bfloat16, dof=690)
    refs = dict(ref_lp=member(1.0), ref_samples=[member(1.0)])
    assert not judge(got=got, **refs, **common).ok  # F(132) = 2.07: the old model's false alarm
    assert judge(got=got, grad_dof=dof, **refs, **common).ok


def test_a_weight_grad_whose_tokens_weigh_alike_gets_a_tighter_bound_than_a_quarter_of_them():
    gen = torch.Generator().manual_seed(25)
    x, g = _terms(24, 32, 32, gen)
    dof = weight_grad_dof(x, g)
    assert dof >= 24  # capped at the tokens by the check: F(24) = 3.0, where a quarter gave F(6) = 6.3
    ref64 = (g.T @ x) / 24
    common = dict(kind="grad", name="fc1.weight", step=0, rank=0, ref64=ref64, dtype=torch.bfloat16, dof=24)
    refs = dict(ref_lp=_bf16_like(ref64, gen, 0.01), ref_samples=[_bf16_like(ref64, gen, 0.01)])
    scaled = _bf16_like(ref64, gen, 0.01) * 1.05
    assert judge(got=scaled, **refs, **common).ok
    assert not judge(got=scaled, grad_dof=dof, **refs, **common).ok
    assert judge(got=_bf16_like(ref64, gen, 0.01), grad_dof=dof, **refs, **common).ok


def test_bias_grad_dof_counts_elements_that_weigh_alike():
    gen = torch.Generator().manual_seed(26)
    g = torch.randn(200, 64, generator=gen, dtype=torch.float64)
    assert 45 < bias_grad_dof(g) <= 64  # 48.5 per token: 200 random vectors in 64 dims
    assert bias_grad_dof(g[:, :1]) == 1.0  # a scalar's error is one normal, however many tokens
    g[:, 0] *= 100
    assert bias_grad_dof(g) < 1.1


def test_bias_grad_dof_counts_tokens_where_their_output_grads_share_a_direction():
    """A bias whose tokens' output grads share one direction (an upstream error moves a token's
    whole grad vector) errs as a sum of one vector per token: its elements alone would count 64
    independent normals where the tokens that carry it are few (ulysses-gpt, --seed 5854: a
    correct fc1 bias at err / noise 2.19 with 459 elements counted)."""
    gen = torch.Generator().manual_seed(27)
    direction = torch.randn(64, generator=gen, dtype=torch.float64)
    g = torch.randn(200, 1, generator=gen, dtype=torch.float64) * direction  # (200, 64), rank one
    assert bias_grad_dof(g) < 1.1
    few = torch.randn(6, 64, generator=gen, dtype=torch.float64)  # 6 tokens: at most 6 directions
    assert 3 < bias_grad_dof(few) <= 6


def test_the_float64_reference_derives_each_ranks_linear_pieces_from_its_own_terms():
    # what the owner of the float64 reference does for every rank: record each nn.Linear's
    # per-token inputs and output grads in its pass, and derive each piece's degrees of freedom
    from sp_harness.checks.references import LinearPiece, piece_noise
    from sp_harness.reference.gpt import GPT, GPTConfig
    from sp_harness.step.reference import LinearTerms

    torch.manual_seed(27)
    model = GPT(GPTConfig(hidden=32, ffn=64, num_layers=1)).double()
    terms = LinearTerms(model)
    with terms:
        out = model(torch.randint(0, 64, (2, 12)))
        torch.nn.functional.cross_entropy(out.reshape(-1, 64), torch.randint(0, 64, (24,))).backward()
    inputs, out_grads = terms.terms()
    assert inputs["blocks.0.mlp.fc1"].shape == (24, 32) and out_grads["blocks.0.mlp.fc1"].shape == (24, 64)
    halves = (torch.arange(32), torch.arange(32, 64))
    pieces = [LinearPiece(rank=r, name="blocks.0.mlp.fc1.weight", rows=halves[r], cols=torch.arange(32)) for r in (0, 1)]
    pieces += [LinearPiece(rank=1, name="blocks.0.mlp.fc1.bias", rows=halves[1], cols=None),
               LinearPiece(rank=0, name="blocks.0.norm1.weight", rows=torch.arange(32), cols=None)]
    grads = {n: p.grad for n, p in model.named_parameters()}
    noise = piece_noise(terms, pieces, grads)
    dofs = {k: v.dof for k, v in noise.items()}
    x, g = inputs["blocks.0.mlp.fc1"], out_grads["blocks.0.mlp.fc1"]
    for r in (0, 1):
        assert dofs[(r, "blocks.0.mlp.fc1.weight")] == weight_grad_dof(x, g[:, halves[r]])
    assert dofs[(1, "blocks.0.mlp.fc1.bias")] == bias_grad_dof(g[:, halves[1]])
    # a norm's weight: never more than the quarter of its tokens (tests/test_grad_scale.py)
    assert dofs[(0, "blocks.0.norm1.weight")] <= 24 * 0.25


def test_a_plain_weight_grad_leaves_alt_out_and_a_cancelling_or_noisy_one_keeps_it():
    # members at 1 u, alt at 6 u (alt / 3 sets the noise when it counts): a Linear weight piece
    # whose terms add in general position (cancellation 1.0) is judged on the members alone and
    # catches a 1.2% scale that the alt term passes; a cancelling sum (3.0), or members erring
    # past PLAIN_NOISE_UNITS of the piece, keep alt / 3
    from sp_harness.compare.grad_scale import PieceNoise
    from sp_harness.compare.tolerance import NO_CANCELLATION, PLAIN_NOISE_UNITS

    gen = torch.Generator().manual_seed(11)
    ref64 = torch.randn(256, 64, generator=gen, dtype=torch.float64)
    u = 2.0 ** -8
    members = (_bf16_like(ref64, gen, u), _bf16_like(ref64, gen, u))
    scaled = _bf16_like(ref64, gen, u) * 1.012

    def judged(cancellation: float, members, alt_rel: float):
        alt = _bf16_like(ref64, gen, alt_rel)
        return alt, judge(kind="grad", name="fc1.weight", step=0, rank=0, got=scaled, ref64=ref64,
                                 ref_lp=members[0], ref_alt=alt, dtype=torch.bfloat16, dof=512,
                                 ref_samples=[members[1]],
                                 grad_noise=PieceNoise(dof=512, share=0.01, cancellation=cancellation))

    def third(alt):
        return float((alt - ref64).norm()) / tolerance.ALT_OVERESTIMATE

    alt, plain = judged(1.0, members, 6 * u)
    assert not plain.ok and plain.noise_norm < third(alt), plain.describe()
    alt, cancelling = judged(NO_CANCELLATION * 2, members, 6 * u)
    assert cancelling.ok and cancelling.noise_norm == third(alt), cancelling.describe()
    noisy = (_bf16_like(ref64, gen, PLAIN_NOISE_UNITS * 1.2 * u), _bf16_like(ref64, gen, PLAIN_NOISE_UNITS * 1.2 * u))
    alt, kept = judged(1.0, noisy, 4.5 * PLAIN_NOISE_UNITS * u)
    assert kept.noise_norm == third(alt) > max(float((m - ref64).norm()) for m in noisy)


def test_the_max_abs_bound_counts_the_members_where_alt_errs_little():
    # a structurally zero grad of 4 elements: alt's one draw erred 1.1e-5, 'rounded' 8.6e-5, the
    # run 5.8e-4 (the fourteenth session's one-key GQA ring): FACTOR x the larger passes it
    zero = torch.zeros(1, 4, dtype=torch.float64)
    common = dict(kind="grad", name="k_proj.weight", step=0, rank=0, ref64=zero, ref_lp=zero,
                  ref_alt=torch.tensor([[2.9e-6, -7e-7, 4.5e-6, -1.1e-5]], dtype=torch.float64), dtype=torch.bfloat16,
                  dof=1, got=torch.tensor([[-1.44e-4, 3.5e-5, -2.44e-4, 5.84e-4]], dtype=torch.float64))
    assert not judge(**common).ok
    member = torch.tensor([[2.1e-5, -5.1e-6, 3.6e-5, -8.6e-5]], dtype=torch.float64)
    assert judge(ref_samples=[member], **common).ok


def test_a_weight_grads_degrees_of_freedom_are_the_fewer_of_its_two_error_terms():
    # E = sum_t dg_t x_t^T + g_t dx_t^T: where one side's relative errors are far larger (a unit's
    # input that is itself a cancellation) its term alone sets E, so the count is the fewer of the
    # two terms' own Satterthwaite counts, whatever their weights
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(60, 2, generator=gen, dtype=torch.float64)
    x[:, 0] *= 0.05  # a unit that barely fires: its column carries little of the terms
    g = torch.randn(60, 150, generator=gen, dtype=torch.float64) + 3 * torch.randn(1, 150, generator=gen,
                                                                                   dtype=torch.float64)
    a = (g.square() @ g.square().T) * (x @ x.T).square()  # tr C_g^2 by token pairs
    b = (g @ g.T).square() * (x.square() @ x.square().T)  # tr C_x^2
    trace = float((g.square().sum(1) * x.square().sum(1)).sum())
    assert weight_grad_dof(x, g) == pytest.approx(min(trace**2 / float(a.sum()), trace**2 / float(b.sum())))


def test_a_narrow_weight_piece_keeps_alt_however_plain_its_sum():
    from sp_harness.compare.grad_scale import PieceNoise
    from sp_harness.compare.tolerance import PLAIN_MIN_WIDTH

    gen = torch.Generator().manual_seed(13)
    u = 2.0 ** -8
    for width, keeps in ((PLAIN_MIN_WIDTH - 1, True), (PLAIN_MIN_WIDTH, False)):
        ref64 = torch.randn(150, width, generator=gen, dtype=torch.float64)
        members = [_bf16_like(ref64, gen, u) for _ in range(2)]
        alt = _bf16_like(ref64, gen, 9 * u)
        chk = judge(kind="grad", name="fc2.weight", step=0, rank=0, got=members[0], ref64=ref64,
                           ref_lp=members[0], ref_alt=alt, dtype=torch.bfloat16, dof=300, ref_samples=[members[1]],
                           grad_noise=PieceNoise(dof=300, share=0.01, cancellation=1.0))
        third = float((alt - ref64).norm()) / tolerance.ALT_OVERESTIMATE
        assert (chk.noise_norm == third) is keeps, (width, chk.noise_norm, third)


def test_the_reference_names_its_attention_projections_which_keep_alt():
    from sp_harness.reference.gpt import GPT, GPTConfig
    from sp_harness.step.reference import LinearTerms

    terms = LinearTerms(GPT(GPTConfig(vocab=11, hidden=8, num_heads=2, ffn=16, num_layers=1, max_seq_len=8)))
    assert terms.in_attention == {f"blocks.0.attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")}
    assert {"blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "lm_head"} <= set(terms.linears) - terms.in_attention
