"""The training-step check judges collective-safely and says where it cannot judge, on a user's
own step (tests/clip_cases.py: a hand-written TP + SP MLP with a head).

- a step whose grads fail on one rank only FAILs at the grads, naming the stage: the engine's own
  collectives (the uniform-factor fit) run on every rank whatever each rank's verdict;
- the clip norm's composition is judged against the float64 norm of the step's own grads with the
  rounding of the norm's own arithmetic (float32 sums), so a param left out of the norm or counted
  twice FAILs by name in float32 and bfloat16 alike, and a correct clipped step PASSes in both;
- a figure whose bound cannot tell it from the wrong value its stage catches (bfloat16's clip
  coefficient, whose update rounds away) is reported not judged, never ok."""

import math
import os

import pytest

from sp_harness.checks import train_step
from sp_harness.checks.train_step import STAGE_LABEL
from sp_harness.config.check_config import CheckConfig
from sp_harness.report.result_text import format_result

CASES = os.path.join(os.path.dirname(__file__), "clip_cases.py")
CLIP = 0.01
"""Far below the grad norm at init (about 0.9 here): clipping is active at every step."""


def _check(sp_pool, name, **fields):
    fields = {"world_size": 2, "optimizer": "sgd", "clip_grad_norm": CLIP, **fields}
    return train_step.check(CheckConfig(case=f"{CASES}:{name}", train_step=True, **fields), sp_pool)


@pytest.mark.parametrize("name, world_size", [
    # the reported shape: at TP 2, DP 1 the rank without a valid token is the only one left wrong
    ("SKIP_SEQ_SYNC", 2),
    ("EMPTY_RANK_KEEPS_OWN", 4),
])
def test_grads_wrong_on_one_rank_only_fail_at_the_grads_not_in_a_collective(sp_pool, name, world_size):
    res = _check(sp_pool, name, world_size=world_size, steps=1)
    assert not res.error and not res.crash_kind, res.reason + res.error
    assert res.verdict == "FAIL" and STAGE_LABEL[res.first_check] == "grads before clipping", format_result(res)
    grads = [f for f in res.failures if f.kind == "grad"]
    assert {f.rank for f in grads} == {world_size - 1}, [f.describe() for f in grads]
    assert {f.name for f in grads} <= {"down.bias", "head.weight"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, param", [("CLIP_SKIPS_DOWN", "down.weight"), ("HEAD_COUNTED_TWICE", "head.weight")])
def test_a_param_left_out_of_the_clip_norm_or_counted_twice_fails_by_name(sp_pool, name, param, dtype):
    res = _check(sp_pool, name, dtype=dtype, steps=1)
    assert res.verdict == "FAIL" and res.first_check == "grad_norm", format_result(res)
    first = res.failures[0]
    assert first.step == 0 and first.name == f"{param} in the norm", first.describe()
    # the share is 0 (left out) or twice itself: the share's own size away
    assert first.ratio > 8, first.describe()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed, mesh", [
    (0, dict(world_size=2)),
    pytest.param(1, dict(world_size=2), marks=pytest.mark.exhaustive("the fast tier runs seed 0 at TP 2")),
    pytest.param(2, dict(world_size=2), marks=pytest.mark.exhaustive("the fast tier runs seed 0 at TP 2")),
    pytest.param(0, dict(world_size=4, dp=2), marks=pytest.mark.exhaustive("the fast tier runs TP 2, DP 1")),
    pytest.param(1, dict(world_size=4), marks=pytest.mark.exhaustive("the fast tier runs TP 2, DP 1")),
])
def test_a_correct_clipped_step_passes(sp_pool, dtype, seed, mesh):
    res = _check(sp_pool, "CORRECT", dtype=dtype, seed=seed, **mesh)
    assert res.verdict == "PASS", format_result(res)
    composition = [c for c in res.vacuous if c.kind == "grad_norm"]
    assert "grad_norm" in res.worst and not composition, format_result(res)


def test_a_bfloat16_clip_coefficient_that_cannot_be_judged_is_reported_not_judged(sp_pool):
    res = _check(sp_pool, "CORRECT", dtype="bfloat16", steps=1)
    # its update (lr x coefficient x grad) is far below a bfloat16 param's half ulp: a coefficient
    # of 0 would pass the fit's bound, so the stage is not judged, and says so
    assert res.verdict == "PASS" and "clip" not in res.worst, format_result(res)
    clip = [c for c in res.vacuous if c.kind == "clip"]
    assert clip and clip[0].vacuous >= 1, format_result(res)
    assert "not judged in bfloat16" in format_result(res) and "clip clip coefficient" in format_result(res)
    # float32 resolves the same update: its coefficient is judged
    res32 = _check(sp_pool, "CORRECT", dtype="float32", steps=1)
    assert res32.verdict == "PASS" and "clip" in res32.worst and not res32.vacuous, format_result(res32)


def test_a_figure_is_judged_only_where_its_bound_is_below_the_distance_it_must_resolve():
    from sp_harness.checks.train_step_rank import _judged

    fields = dict(kind="grad_norm", name="w in the norm", step=0, rank=0)
    judged = _judged(got=0.0, want=1.0, bound=0.05, apart=1.0, **fields)
    assert not judged.ok and judged.ratio == pytest.approx(20.0) and judged.vacuous == 0
    withheld = _judged(got=0.0, want=1.0, bound=1.02, apart=1.0, **fields)
    assert withheld.ok and withheld.ratio == 0 and withheld.vacuous == pytest.approx(1.02)
    assert withheld.withheld_ratio == pytest.approx(1 / 1.02)
    # a share of exactly zero is known exactly: judged, any share the norm invents fails
    assert not _judged(got=1e-30, want=0.0, bound=0.0, apart=0.0, **fields).ok
    # a non-finite norm is judged whatever its bound
    assert not _judged(got=math.inf, want=1.0, bound=2.0, apart=1.0, **fields).ok


def test_a_clip_coefficient_is_judged_only_where_its_bound_separates_it_from_0_and_1():
    from sp_harness.checks.train_step_rank import CLIP_NOT_JUDGED, _clip_check

    judged, _ = _clip_check(step=0, rank=0, got=0.2, coef=0.1, bound=0.01)
    assert judged is not None and not judged.ok and judged.ratio == pytest.approx(10.0)
    # bfloat16's SGD update rounds away: a bound thousands of times the coefficient passes a 0
    withheld, _ = _clip_check(step=0, rank=0, got=0.0, coef=0.01, bound=13.0)
    assert withheld is not None and withheld.ok and withheld.vacuous == pytest.approx(1300.0)
    # barely clipping: a coefficient of 1 (clipping skipped) would pass, so no check, and why
    none, why = _clip_check(step=3, rank=0, got=1.0, coef=0.99999, bound=5e-5)
    assert none is None and why.startswith(CLIP_NOT_JUDGED) and "step 3" in why
