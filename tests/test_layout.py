"""The tree's own structure (issue 12): stages import only downward, every package is installed
under the one `sp_harness` namespace, and every check is pluggable."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = ["config", "launch", "step", "capture", "compare", "train", "record", "judge", "checks", "report", "suites"]
"""The flow, bottom to top: a module may import from its own stage and the ones before it."""
TOP = 99  # the CLI, the pytest plugin and the public API may import anything


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "sp_harness":
        return None
    if len(parts) > 1 and parts[1] in STAGES:
        return STAGES.index(parts[1])
    if len(parts) > 1 and parts[1] in ("cases", "reference"):
        return -1  # systems under test: plugins below the engine, loaded by the registry
    return TOP


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _engine_modules():
    for path in sorted((ROOT / "harness").rglob("*.py")):
        rel = path.relative_to(ROOT / "harness").with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        yield path, ".".join(["sp_harness", *parts])


def test_no_module_imports_from_a_stage_above_it():
    upward = []
    for path, module in _engine_modules():
        mine = _stage(module) if module != "sp_harness" else TOP
        for name in _imports(path):
            theirs = _stage(name)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} imports {name}")
    assert not upward, "\n".join(upward)


def test_the_engine_does_not_import_the_cases():
    # cases are found through the registry; an engine module naming one would tie it to a case
    named = [f"{module} imports {name}" for path, module in _engine_modules() for name in _imports(path)
             if name.startswith("sp_harness.cases") and module not in ("sp_harness.suites.sensitivity",)]
    assert not named, "\n".join(named)


def test_every_package_is_installed_under_the_namespace():
    # setup.py finds the packages; a strict editable install links the files it had when it ran,
    # so a module added since is missing until `pip install -e .` runs again: this names it
    import importlib.resources
    import importlib.util

    missing = []
    for ns, folder in {"sp_harness": "harness", "sp_harness.cases": "cases", "sp_harness.reference": "reference"}.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            if importlib.util.find_spec(".".join([ns, *parts])) is None:
                missing.append(".".join([ns, *parts]))
    assert not missing, f"not installed (run `pip install -e .` again): {missing}"
    assert importlib.resources.files("sp_harness").joinpath("py.typed").is_file()  # PEP 561: typed


def test_checks_are_discovered_and_typed():
    from sp_harness.checks import Check, all_checks

    checks = all_checks()
    assert {"side-by-side", "comm-vs-baseline", "activation-memory", "lockstep"} <= set(checks)
    assert all(isinstance(c, Check) for c in checks.values())


def test_the_battery_runs_only_known_checks():
    from sp_harness.checks import all_checks
    from sp_harness.suites.battery import BATTERY

    assert {e.check for e in BATTERY} <= set(all_checks())


@pytest.mark.parametrize("bad", ["harness", "cases", "reference"])
def test_no_bare_top_level_import_names(bad):
    # the installed names never collide with a user's own `harness`, `cases` or `reference`
    leaks = [f"{module} imports {name}" for path, module in _engine_modules() for name in _imports(path)
             if name == bad or name.startswith(bad + ".")]
    assert not leaks, "\n".join(leaks)
