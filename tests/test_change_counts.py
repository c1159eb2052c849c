"""docs/architecture.md's "What a change touches" stays true for a check and a mutant: a check is
one module that every place listing checks finds with no other edit, and a mutant's name is
written in exactly two files, its module and its registry table. Pure: no process group."""

import importlib
import re
from pathlib import Path

import pytest

import sp_harness.checks as checks_package
from sp_harness.cases import BUILTIN
from sp_harness.cases.frameworks import FRAMEWORK_CASES
from sp_harness.checks import all_checks, get_check, run_check
from sp_harness.config.registry import all_cases
from sp_harness.report.text import format_outcomes, outcomes_json
from sp_harness.suites.battery import Battery, Entry, mutant_names

ROOT = Path(__file__).resolve().parents[1]
ROWS = {"a check": "1, or 2 with a rank job (+1 test)", "a mutant": "2"}
"""The rows this test keeps true, as the table states their counts."""

PROBE = '''
from sp_harness.checks.base import Outcome


class Probe:
    name = "probe-check"
    label = "probe"

    def applies(self, case, config):
        return None

    def run(self, config, runner):
        return Outcome(check=self.name, status="pass", detail="probed", figures={"seen": config.case})

    def render(self, outcome):
        return f"probe-check: {outcome.detail} {outcome.figures['seen']}"


CHECK = Probe()
'''


def _table_row(change: str) -> str:
    text = (ROOT / "docs/architecture.md").read_text()
    match = re.search(rf"^\| {re.escape(change)} \| ([^|]+) \|", text, re.M)
    assert match, f"docs/architecture.md has no 'What a change touches' row for {change!r}"
    return match.group(1).strip()


@pytest.mark.parametrize("change", sorted(ROWS))
def test_the_table_states_the_counts_this_test_keeps(change):
    assert _table_row(change) == ROWS[change]


def test_a_check_is_one_module(tmp_path, monkeypatch):
    (tmp_path / "probe_check.py").write_text(PROBE)
    monkeypatch.setattr(checks_package, "__path__", [*checks_package.__path__, str(tmp_path)])
    monkeypatch.setattr(checks_package, "_CHECKS", None)
    try:
        assert "probe-check" in all_checks()
        # what `check --also probe-check` resolves, a battery entry runs, the text and the JSON print
        outcome = run_check(get_check("probe-check"), Entry(name="probe", check="probe-check").config("seed-mlp"),
                            runner=None)  # type: ignore[arg-type]
        assert Battery(runner=None).evaluate("seed-mlp", Entry(name="probe", check="probe-check")).passed  # type: ignore[arg-type]
        assert format_outcomes([outcome]) == "probe-check: probed seed-mlp"
        assert outcomes_json([outcome])["outcomes"][0]["figures"] == {"seen": "seed-mlp"}
    finally:
        import sys

        sys.modules.pop("sp_harness.checks.probe_check", None)
        checks_package._CHECKS = None


def _registry() -> dict[str, tuple[Path, Path]]:
    """mutant -> (the module that registers it, the table that names that module)."""
    where = {}
    for module, names in BUILTIN.items():
        for name in names:
            where[name] = (module, ROOT / "cases/__init__.py")
    for module, names in FRAMEWORK_CASES.values():
        for name in names:
            where[name] = (module, ROOT / "cases/frameworks/__init__.py")
    return {name: (Path(importlib.util.find_spec(module).origin).resolve(), table)  # type: ignore[union-attr,arg-type]
            for name, (module, table) in where.items()}


def test_a_mutant_is_written_in_its_module_and_its_registry_table_alone():
    sources = {p.resolve(): p.read_text() for folder in ("harness", "cases", "reference")
               for p in (ROOT / folder).rglob("*.py")}
    registry = _registry()
    # the link tree of the editable install points at the sources: compare real paths
    registry = {name: (module.resolve(), table.resolve()) for name, (module, table) in registry.items()}
    present = all_cases()
    for name in mutant_names():
        assert name in registry and name in present
        written = {path for path, text in sources.items() if f'"{name}"' in text}
        assert written == set(registry[name]), (
            f"{name} is written in {sorted(str(p.relative_to(ROOT)) for p in written)}; a mutant is declared in its "
            f"module and named in its registry table only")

