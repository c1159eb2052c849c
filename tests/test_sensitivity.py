"""The scaled mutants behind `sp-harness sensitivity`: each FAILs at a relative error d = 1e-6 in
float64 (a million times above the float64 targets' 1e-10 would still be caught) and PASSes at
d = 0, where its hooks are installed but change nothing (no false alarm from the machinery).
The scaled mutants stay out of the default mutant battery."""

import os

import pytest

from sp_harness.cases.megatron.scaled_mutants import CASES, ENV, EVERY_RANK, set_scale
from sp_harness.config.check_config import CheckConfig
from sp_harness.suites.sensitivity import caught_by

EXPECTED_CATCH = {"forward": "forward", "grad": "grad", "update": "param", "norm-grad": "grad"}


@pytest.fixture
def scaled(sp_pool):
    """run(shape, d) -> CheckResult of the scaled mutant at d (float64, world size 2)."""
    from sp_harness.checks.side_by_side import check

    previous = os.environ.get(ENV)

    def run(shape, d):
        set_scale(sp_pool, d)
        return check(CheckConfig(case=CASES[shape].name, world_size=2, timeout_s=120.0), sp_pool)

    yield run
    set_scale(sp_pool, None if previous is None else float(previous))


@pytest.mark.parametrize("shape", sorted(CASES))
def test_scaled_mutant_fails_at_1e6_passes_at_0(scaled, shape):
    res = scaled(shape, 1e-6)
    assert res.verdict == "FAIL", (shape, res.reason)
    assert caught_by(res) == EXPECTED_CATCH[shape], res.first_failure
    first = res.failures[0]
    assert (first.rank == 1 or shape in EVERY_RANK) and first.step == 0, first.describe()
    res = scaled(shape, 0.0)
    assert res.verdict == "PASS", (shape, res.reason)


def test_scaled_mutants_are_not_in_the_battery():
    from sp_harness.config.registry import all_cases
    from sp_harness.suites.battery import mutant_names

    names = set(mutant_names())
    scaled = {n for n, c in all_cases().items() if "scaled" in c.tags}
    assert scaled == {c.name for c in CASES.values()}
    assert not names & scaled


def test_the_norm_wise_criterion_catches_what_max_abs_cannot(sp_pool):
    """bfloat16, one rank's logits x 1.3: every element stays inside the max-abs bound (the
    reference's worst element is that noisy), but the error adds up coherently over the piece."""
    from sp_harness.checks.side_by_side import check

    set_scale(sp_pool, 0.3)
    try:
        res = check(CheckConfig(case=CASES["forward"].name, world_size=2, dtype="bfloat16", timeout_s=120.0), sp_pool)
    finally:
        set_scale(sp_pool, None)
    assert res.verdict == "FAIL"
    first = res.failures[0]
    assert first.kind == "forward" and first.rank == 1
    assert first.max_abs <= first.allowed < float("inf")  # inside the elementwise bound
    assert first.norm_ratio > 1  # caught norm-wise


def test_a_bf16_update_two_percent_off_is_caught_by_its_scale_alone(sp_pool):
    """bfloat16, one param's update on one rank x 1.02 (the sensitivity target at the default
    size): every element inside the elementwise bound (whose bf16 sensitivity is 6.5%), the
    step's coherent scale past its bound (sp_harness.compare.update_scale); at d = 0 it passes."""
    res = _bf16_scaled(sp_pool, "update", 0.02)
    assert res.verdict == "FAIL", res.reason
    first = res.failures[0]
    assert first.kind == "param" and first.rank == 1
    assert first.ratio <= 1 < first.norm_ratio, first.describe()
    assert "update scale" in first.note
    assert _bf16_scaled(sp_pool, "update", 0.0).verdict == "PASS"


def test_bf16_logits_one_and_a_half_percent_off_are_caught_by_their_coherent_scale_alone(sp_pool):
    """bfloat16, one rank's logits x 1.015 at the default size (below the sensitivity target,
    2%): every element inside its max-abs bound and the error norm inside the ensemble's
    norm-wise bound (whose sensitivity is 3.5%), the piece's component along the exact logits
    past the band correct runs span (sp_harness.compare.output_scale); at d = 0 it passes."""
    res = _bf16_scaled(sp_pool, "forward", 0.015)
    assert res.verdict == "FAIL", res.reason
    first = res.failures[0]
    assert first.kind == "forward" and first.rank == 1
    assert first.max_abs <= first.allowed and first.norm_ratio <= 1 < first.scale_ratio, first.describe()
    assert abs(first.scale - 0.015) < 0.005 and "coherent scale" in first.describe()
    assert _bf16_scaled(sp_pool, "forward", 0.0).verdict == "PASS"


def _bf16_scaled(sp_pool, shape: str, d: float, size: str = "default"):
    """A bfloat16 check of the sensitivity mutant of `shape` at d, on 2 ranks, at `size`
    (sp_harness.suites.sensitivity.sized)."""
    from sp_harness.checks.side_by_side import check
    from sp_harness.suites.sensitivity import sized

    set_scale(sp_pool, d)
    try:
        config = CheckConfig(case=CASES[shape].name, world_size=2, dtype="bfloat16", timeout_s=300.0)
        return check(sized(config, size), sp_pool)
    finally:
        set_scale(sp_pool, None)


@pytest.mark.exhaustive("the fast tier pins the same bf16 grad bound at the default size (8% off caught by its "
                        "derived degrees of freedom, 4% recorded as the coherent scale); this figure, issue 23's "
                        "training-size target, moves only with a tolerance change, before which the full tier runs")
def test_a_bf16_grad_one_point_two_percent_off_is_caught_at_the_training_like_size(sp_pool):
    """bfloat16, one rank's fc1 weight grad x 1.012 at hidden 256, 512 tokens: the piece is a
    plain sum (its terms do not cancel, its members err about 1 u), so the perturbed reference's
    term, 2.2x the members', no longer sets its noise, and the floor adds in quadrature (issue 23's
    training-size target, 0.01, met at 0.0093; 0.019 before, which passed this). d = 0 passes."""
    res = _bf16_scaled(sp_pool, "grad", 0.012, "training")
    assert res.verdict == "FAIL", res.reason
    first = res.failures[0]
    assert first.name == "blocks.0.mlp.fc1.weight" and first.rank == 1 and first.norm_ratio > 1, first.describe()
    correct = _bf16_scaled(sp_pool, "grad", 0.0, "training")
    assert correct.verdict == "PASS", correct.reason


@pytest.mark.exhaustive("the fast tier catches the same piece (rank 1's fc1 weight grad, bfloat16, default size) "
                        "at half this error, 4%, by the same norm-wise bound at its derived degrees of freedom "
                        "(6 < dof <= 24 asserted there) in test_a_bf16_grads_coherent_scale_is_recorded_where_a_"
                        "four_percent_scaled_piece_stands_out")
def test_a_bf16_grad_eight_percent_off_is_caught_where_its_linear_counts_its_own_degrees_of_freedom(sp_pool):
    """bfloat16, one rank's fc1 weight grad x 1.08 at the default size (24 tokens): a quarter of
    the tokens (m = 6, F = 6.3) passed it (sensitivity 0.12); the degrees of freedom the float64
    reference derives from the Linear's per-token terms (20-24: F = 3.0-3.2) catch it, and the
    failure says how many it counted."""
    res = _bf16_scaled(sp_pool, "grad", 0.08)
    assert res.verdict == "FAIL", res.reason
    first = res.failures[0]
    assert first.kind == "grad" and first.name == "blocks.0.mlp.fc1.weight" and first.rank == 1
    # the norm-wise bound with its derived degrees of freedom catches it on its own (the coherent
    # scale along the exact grad, which also sees it, is the next test's)
    assert 6 < first.dof <= 24 and first.norm_ratio > 1, first.describe()


def test_a_bf16_grads_coherent_scale_is_recorded_where_a_four_percent_scaled_piece_stands_out(sp_pool):
    """bfloat16, one rank's fc1 weight grad x 1.04 at the default size: its component along the
    exact grad is past the band correct runs span (sp_harness.compare.grad_scale), recorded as
    the check's worst scale ratio but not judged. The verdict is the norm-wise bound's: since the
    fourteenth session (no alt term on a plain sum, the floor in quadrature) it catches 0.034
    there too, so the piece FAILs on its norm while its recorded scale says the same; at d = 0
    the piece stays inside both."""
    res = _bf16_scaled(sp_pool, "grad", 0.04)
    assert res.verdict == "FAIL", res.reason
    first = res.failures[0]
    assert first.kind == "grad" and first.name == "blocks.0.mlp.fc1.weight" and first.rank == 1, first.describe()
    # caught norm-wise at the degrees of freedom the float64 reference derives from the Linear's
    # per-token terms (a quarter of the tokens, m = 6, passed twice this error: the test above)
    assert 6 < first.dof <= 24 and first.norm_ratio > 1, first.describe()
    assert res.worst_scale is not None and res.worst_scale.scale_ratio > 1, res.worst_scale
    assert res.worst_scale.name == "blocks.0.mlp.fc1.weight" and res.worst_scale.rank == 1
    correct = _bf16_scaled(sp_pool, "grad", 0.0)
    assert correct.verdict == "PASS", correct.reason
    assert correct.worst_scale is not None and correct.worst_scale.scale_ratio < 1


def test_a_bf16_norm_grad_half_off_is_caught_by_its_small_piece_norm_bound(sp_pool):
    """bfloat16, a replicated LayerNorm weight's grad (32 elements) x 1.5 on every rank: every
    element inside its max-abs bound (16x the perturbed reference's worst element, which passed a
    zero tensor there: the grad was not judged), the error norm past the ensemble's norm-wise
    bound at the piece's own few degrees of freedom (dof.member_dof); d = 0 passes."""
    res = _bf16_scaled(sp_pool, "norm-grad", 0.5)
    assert res.verdict == "FAIL", res.reason
    first = res.failures[0]
    assert first.kind == "grad" and first.name == "blocks.0.norm1.weight", first.describe()
    assert first.max_abs <= first.allowed and first.norm_ratio > 1 and 1 <= first.dof < 32, first.describe()
    assert _bf16_scaled(sp_pool, "norm-grad", 0.0).verdict == "PASS"
