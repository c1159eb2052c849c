"""The case API pieces frameworks need (issue 19, deliverable 4), each on real gloo ranks with a
user case file and a mutant it must catch: vocab-parallel outputs (`Layout.split_dim`), DTensor
outputs gathered to their declared layout, non-tensor inputs with `Sharded.prepare_inputs`,
grads read from `Sharded.grad_attr`, forward-only checks, named groups and `ctx.once`, and the
names the README imports from `sp_harness`."""

import ast
import importlib
import os
import pathlib
import re

import pytest
import torch

from sp_harness.config.case import Layout
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.judge.verdict import FAIL, PASS

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = os.path.join(ROOT, "tests", "caseapi_cases.py")
VOCAB = os.path.join(ROOT, "examples", "vocab_parallel.py")


def _case(name: str, file: str = CASES) -> str:
    return f"{file}:{name}"


# ------------------------------------------------------------------ split_dim (vocab-parallel)


@pytest.mark.parametrize("name,world_size,dp", [("VOCAB_LM", 2, 1), pytest.param("VOCAB_LM", 3, 1, marks=pytest.mark.exhaustive(
    "the fast tier splits vocab 10 at 3 ranks with VOCAB_LM_PADDED")), ("VOCAB_LM_PADDED", 3, 1),
                                                ("VOCAB_LM", 4, 2)])
def test_vocab_parallel_head_passes_judged_piecewise(sp_check, name, world_size, dp):
    # vocab 10: 5/5, 4/4/2 (torch.chunk), 6/2/2 (explicit split_sizes), 5/5 under dp 2
    res = sp_check(CheckConfig(case=_case(name, VOCAB), world_size=world_size, dp=dp))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "input_grad", "grad"} <= set(res.worst)


@pytest.mark.parametrize("name", ["VOCAB_LM_NO_MAX_REDUCE", "VOCAB_LM_LOSS_SHARE"])
def test_vocab_parallel_loss_bugs_fail_at_the_loss(sp_check, name):
    res = sp_check(CheckConfig(case=_case(name, VOCAB), world_size=3))
    assert res.verdict == FAIL and res.first_check == "loss", res.reason + res.error


def test_a_loss_that_consumes_the_output_in_place_does_not_change_the_judged_output(sp_check):
    # megatron-core's vocab-parallel cross entropy overwrites float32 logits with their softmax
    res = sp_check(CheckConfig(case=_case("VOCAB_LM_IN_PLACE_LOSS", VOCAB), world_size=2, dtype="float32"))
    assert res.verdict == PASS, res.reason + res.error


def test_a_split_output_without_local_loss_is_an_error_naming_the_case(sp_check):
    res = sp_check(CheckConfig(case=_case("SPLIT_WITHOUT_LOCAL_LOSS"), world_size=2))
    assert res.verdict == FAIL and "ValueError" in res.error and "SPLIT_WITHOUT_LOCAL_LOSS" in res.error
    assert "Sharded.local_loss" in res.error


def test_split_layouts_are_checked():
    with pytest.raises(ValueError, match="seq_sharded=False"):
        Layout(seq_dim=1, split_dim=-1)
    with pytest.raises(ValueError, match="needs a split_dim"):
        Layout(split_sizes=(2, 2))
    from sp_harness.step.inputs import cut

    ctx = _ctx(world_size=2)
    piece, offset = cut(torch.arange(30.0).reshape(3, 10), Layout(seq_dim=0, seq_sharded=False, split_dim=1,
                                                                   split_sizes=(6, 4)), ctx)
    assert piece.shape == (3, 4) and offset == (0, 6)
    with pytest.raises(ValueError, match="other than its seq_dim"):
        cut(torch.zeros(3, 10), Layout(seq_dim=1, seq_sharded=False, split_dim=-1), ctx)
    with pytest.raises(ValueError, match="split_sizes"):
        cut(torch.zeros(3, 10), Layout(seq_sharded=False, split_dim=1, split_sizes=(5, 4)), ctx)


def _ctx(world_size: int, rank: int = 1) -> RankContext:
    return RankContext(config=CheckConfig(case="x", world_size=world_size), rank=rank, world_size=world_size,
                       dp_rank=0, tp_rank=rank, tp_group=None, dp_group=None, tp_ranks=tuple(range(world_size)),
                       dp_ranks=(rank,), seq_shards=(2,) * world_size, device=torch.device("cpu"))


# ------------------------------------------------------------------ DTensor outputs


@pytest.mark.parametrize("name", ["DTENSOR_HEAD", "DTENSOR_HEAD_SP"])
def test_a_dtensor_output_is_gathered_to_its_declared_layout(sp_check, name):
    # the head's output is a Shard(-1) DTensor: to_local() alone is a column slice of the output
    res = sp_check(CheckConfig(case=_case(name), world_size=2))
    assert res.verdict == PASS, res.reason + res.error
    assert res.worst["forward"].name == "output"


def test_a_mislabelled_dtensor_output_fails(sp_check):
    res = sp_check(CheckConfig(case=_case("DTENSOR_HEAD_MISLABELLED"), world_size=2))
    assert res.verdict == FAIL


# ------------------------------------------------------------------ non-tensor inputs


def test_a_non_tensor_input_reaches_both_sides_and_is_prepared_per_rank(sp_check):
    res = sp_check(CheckConfig(case=_case("MASKED"), world_size=3))
    assert res.verdict == PASS, res.reason + res.error
    assert res.worst["input_grad"].name == "input:x"  # the spec has no grad to judge


def test_a_per_rank_input_built_wrong_fails_on_the_rank_it_is_wrong_for(sp_check):
    res = sp_check(CheckConfig(case=_case("MASKED_NO_OFFSET"), world_size=2))
    assert res.verdict == FAIL and res.first_check == "forward"
    assert {f.rank for f in res.failures if f.kind == "forward"} == {1}


# ------------------------------------------------------------------ grads in main_grad


def test_grads_are_read_from_the_declared_attribute_and_stepped_on(sp_check):
    res = sp_check(CheckConfig(case=_case("MAIN_GRAD"), world_size=2))
    assert res.verdict == PASS, res.reason + res.error
    # the optimizer stepped on main_grad: the same trajectory as the twin keeping grads in .grad
    twin = sp_check(CheckConfig(case=_case("PLAIN_GRAD"), world_size=2))
    assert twin.verdict == PASS and res.losses == pytest.approx(twin.losses, rel=1e-12, abs=0)
    assert len(set(res.losses)) == len(res.losses)


def test_an_unsynced_main_grad_fails_at_grad(sp_check):
    res = sp_check(CheckConfig(case=_case("MAIN_GRAD_UNSYNCED"), world_size=2))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason


# ------------------------------------------------------------------ forward-only


def test_forward_only_judges_the_forward_and_skips_backward(sp_check):
    ok = sp_check(CheckConfig(case=_case("MASKED"), world_size=2, forward_only=True))
    assert ok.verdict == PASS and set(ok.worst) == {"init", "forward", "loss"}
    assert ok.to_json()["not_judged"] == ["input_grad", "grad", "param"]
    # a bug only backward sees: invisible forward-only, caught by the full check
    backward_bug = _case("MASKED_BAD_BACKWARD")
    assert sp_check(CheckConfig(case=backward_bug, world_size=2, forward_only=True)).verdict == PASS
    full = sp_check(CheckConfig(case=backward_bug, world_size=2))
    assert full.verdict == FAIL and full.first_check == "input_grad" and not full.to_json()["not_judged"]
    forward_bug = sp_check(CheckConfig(case=_case("MASKED_NO_OFFSET"), world_size=2, forward_only=True))
    assert forward_bug.verdict == FAIL and forward_bug.first_check == "forward"


def test_a_case_may_default_to_forward_only(sp_check):
    res = sp_check(CheckConfig(case=_case("FORWARD_ONLY_BY_DEFAULT"), world_size=2))
    assert res.verdict == PASS and res.config.forward_only and "--forward-only" not in res.config.repro()
    full = sp_check(CheckConfig(case=_case("FORWARD_ONLY_BY_DEFAULT"), world_size=2, forward_only=False))
    assert full.verdict == FAIL and "--forward-only no" in full.config.repro()


# ------------------------------------------------------------------ named groups, once


def test_named_groups_on_a_2x2_grid_and_a_registry_made_once(sp_check, sp_max_world_size):
    if sp_max_world_size < 4:
        pytest.skip("needs 4 ranks")
    for _ in range(2):  # the second job on the warm pool gets the same groups and registry back
        res = sp_check(CheckConfig(case=_case("GRID"), world_size=4))
        assert res.verdict == PASS, res.reason + res.error
        assert {"row", "col"} <= {row.group for row in res.comm}
    bug = sp_check(CheckConfig(case=_case("GRID_ROW_ONLY"), world_size=4))
    assert bug.verdict == FAIL and bug.first_check == "forward"


def test_new_groups_takes_a_partition_of_the_ranks():
    ctx = _ctx(world_size=4)
    for bad in ([(0, 1), (2,)], [(0, 1), (1, 2, 3)], [(0, 1, 2, 3), ()]):
        with pytest.raises(ValueError, match="not a partition"):
            ctx.new_groups("bad", bad)


def test_once_runs_its_function_once_per_key():
    ctx, calls = _ctx(world_size=2), []
    key = ("test_once", id(calls))
    assert ctx.once(key, lambda: calls.append(1) or "made") == "made"
    assert ctx.once(key, lambda: calls.append(1) or "again") == "made" and calls == [1]


# ------------------------------------------------------------------ exports


def _imported_names(text: str) -> set[str]:
    names = set()
    for match in re.finditer(r"from sp_harness import (\([^)]*\)|[\w ,]+)", text):
        node = ast.parse("from sp_harness import " + match.group(1).strip().rstrip(","))
        names |= {a.name for a in node.body[0].names}
    return names


def test_every_name_the_readme_docs_and_examples_import_from_sp_harness_is_exported():
    texts = [(ROOT / "README.md").read_text(), (ROOT / "docs" / "running.md").read_text()] + [
        p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))]
    names = set().union(*map(_imported_names, texts))
    assert {"Case", "Layout", "Sharded", "Training", "ParamSpec"} <= names  # the parse finds them
    module = importlib.import_module("sp_harness")
    missing = sorted(n for n in names if not hasattr(module, n))
    assert not missing, missing
    wanted = {"Batch", "Example", "Training", "mutant", "Layout", "ParamSpec", "RankContext", "Sharded",
              "Unsupported", "register", "CheckConfig", "check", "Case"}
    assert wanted <= set(module.__all__) and all(hasattr(module, n) for n in module.__all__)
