"""Static checks run with the suite (issue 22): ruff over the tree, and mypy over the package and
over the examples (user case files written against the public API). The README's test command
installs the `lint` extra, so CI runs them; a missing tool is a failure, not a skip."""

from __future__ import annotations

import importlib.util
import os
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


def test_mypy_is_clean_over_the_package_and_the_examples(tmp_path):
    # one mypy over both (`tox -e lint` runs `mypy` and `mypy examples`): the package as the
    # config's `packages` names it, and each example as the top-level module `mypy examples`
    # makes of it (MYPYPATH: the examples' folder); a second process re-read torch's analysis from
    # the cache (1.7 s of ~30). The cache in tmp_path: two xdist workers must not share one
    examples = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
    assert examples, "no examples found"
    env = dict(os.environ, MYPYPATH=os.pathsep.join(filter(None, [str(ROOT / "examples"), os.environ.get("MYPYPATH")])))
    run = subprocess.run(_tool("mypy") + ["-p", "sp_harness", *(a for m in examples for a in ("-m", m)),
                                          "--cache-dir", str(tmp_path / "mypy-cache")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, "mypy (the package and the examples):\n" + (run.stdout + run.stderr)[-6000:]
