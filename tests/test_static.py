"""Static checks run with the suite (issue 22): ruff over the tree, and mypy over the package and
over the examples (user case files written against the public API). The README's test command
installs the `lint` extra, so CI runs them; a missing tool is a failure, not a skip."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tool(module: str) -> list[str]:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: pip install -e '.[frameworks,lint]' (the README's test command)")
    return [sys.executable, "-m", module]


def test_ruff_is_clean():
    run = subprocess.run(_tool("ruff") + ["check", "harness", "cases", "reference", "tests", "examples", "--no-cache"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]


def _mypy(targets: list[str], cache: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(_tool("mypy") + targets + ["--cache-dir", str(cache)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


def test_mypy_is_clean_over_the_package_and_the_examples(tmp_path):
    # one cache in tmp_path for both runs (two xdist workers must not share one): the examples'
    # run reuses the package's analysis instead of redoing it
    for targets in ([], ["examples"]):
        run = _mypy(targets, tmp_path / "mypy-cache")
        assert run.returncode == 0, f"mypy {' '.join(targets) or '(the package)'}:\n" + (run.stdout + run.stderr)[-6000:]
