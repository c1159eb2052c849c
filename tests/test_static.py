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


@pytest.mark.parametrize("args", [["ruff", "check", "harness", "cases", "reference", "tests", "examples"],
                                  ["mypy"], ["mypy", "examples"]], ids=["ruff", "mypy-package", "mypy-examples"])
def test_static_tool_is_clean(args, tmp_path):
    # mypy's cache in tmp_path: two xdist workers must not share one cache directory
    extra = ["--cache-dir", str(tmp_path / "mypy-cache")] if args[0] == "mypy" else ["--no-cache"]
    run = subprocess.run(_tool(args[0]) + args[1:] + extra, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
