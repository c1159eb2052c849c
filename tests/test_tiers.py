"""The fast tier (the default `pytest -n auto`) loses no coverage: every registered check, built-in
case, mutant pin and framework integration is exercised by a test it runs (tests/conftest.py
deselects only tests marked `exhaustive`, each naming what the fast tier runs instead).

What a test exercises is read from the collected items, not declared: its parameters (a case or
mutant name, a CheckConfig's case, a Case's name), the string literals of its function, and for
the mutant battery the mutant, its correct twin and the pinned entry's check."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from sp_harness.cases.frameworks import FRAMEWORK_CASES, installed
from sp_harness.checks import all_checks
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import all_cases
from sp_harness.suites.battery import BATTERY, mutant_names

FRAMEWORK_TESTS = {"megatron.core": "test_megatron_core.py", "yunchang": "test_yunchang.py",
                   "torchtitan": "test_torchtitan.py", "deepspeed": "test_deepspeed.py",
                   "accelerate": "test_hf_trainer.py", "trl": "test_trl.py", "verl": "test_verl.py"}
"""Each framework's integration tests (its examples/ case file on real ranks)."""


def _names_in(value) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, CheckConfig):
        return {value.case}
    if isinstance(value, Case):
        return {value.name}
    if isinstance(value, dict | list | tuple):
        items = value.values() if isinstance(value, dict) else value
        return set().union(*(_names_in(v) for v in items)) if items else set()
    return set()


def _literals(fn) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def exercised(item: pytest.Item) -> set[str]:
    """Case, mutant and check names this collected test runs."""
    names: set[str] = set()
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= _names_in(dict(callspec.params))
    fn = getattr(item, "function", None)
    if fn is not None:
        names |= _literals(fn)
    if item.name.startswith("test_mutant_is_killed_by_its_pinned_check[") and callspec is not None:
        mutant = callspec.params["mutant"]
        case = all_cases()[mutant]
        entry = next(e for e in BATTERY if e.name == case.killed_by[1])
        names |= {mutant, case.twin or "", entry.check}
        if entry.check in ("comm-vs-baseline", "activation-memory", "lockstep") and case.baseline:
            names.add(case.baseline)
    return names


@pytest.fixture
def fast_items(request) -> list[pytest.Item]:
    items = [i for i in request.session.items if not i.get_closest_marker("exhaustive")]
    files = {i.path.name for i in items}
    if "test_mutants.py" not in files or len(files) < 20:
        pytest.skip(f"needs the whole suite collected (this run collected {len(files)} test files)")
    return items


def test_the_fast_tier_exercises_every_check_case_mutant_and_framework(fast_items):
    names = set().union(*(exercised(i) for i in fast_items))
    cases = {n for n, c in all_cases().items() if "mutant" not in c.tags}
    missing = {
        "checks": sorted(set(all_checks()) - names),
        "cases": sorted(cases - names),
        "mutants": sorted(set(mutant_names()) - names),
        "frameworks": sorted(f for f, test_file in FRAMEWORK_TESTS.items()
                             if installed(f) and not any(i.path.name == test_file for i in fast_items)),
    }
    assert not any(missing.values()), f"the fast tier no longer exercises: {missing}"
    assert set(FRAMEWORK_TESTS) == set(FRAMEWORK_CASES)


def test_the_scaled_sensitivity_mutants_are_no_catalogue_entries():
    # the catalogue is what the battery must kill; the scaled mutants are measured by
    # `sp-harness sensitivity` (tests/test_sensitivity.py), so the coverage above need not list them
    scaled = {n for n, c in all_cases().items() if "scaled" in c.tags}
    assert scaled and not scaled & set(mutant_names())
