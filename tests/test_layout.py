"""The tree's own structure (issues 12, 22): stages import only downward, no module imports
itself back through others, every module names its stage, the docs' flow is the code's, every
package is installed under the one `sp_harness` namespace, and every check is pluggable."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from sp_harness.stages import STAGES

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP = 99  # the CLI, the pytest plugin and the public API may import anything
FOLDERS = {"sp_harness": "harness", "sp_harness.cases": "cases", "sp_harness.reference": "reference"}


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


def _modules(folder: str, namespace: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        yield path, ".".join([namespace, *parts])


def _engine_modules():
    yield from _modules("harness", "sp_harness")


def _imported_names(path: pathlib.Path):
    """Every import in the module, a function's too: a lazy import still ties the two modules."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)


def test_no_module_imports_from_a_stage_above_it():
    upward = []
    for path, module in _engine_modules():
        mine = _stage(module) if module != "sp_harness" else TOP
        for name in _imports(path):
            theirs = _stage(name)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} imports {name}")
    assert not upward, "\n".join(upward)


def _import_graph(namespaces) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports, anywhere in it (`from pkg import mod` counts
    as importing `pkg.mod` where that is a module)."""
    modules = {name: path for ns in namespaces for path, name in _modules(FOLDERS[ns], ns)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target, names in _imported_names(path):
            subs = {f"{target}.{n}" for n in names} & modules.keys()
            edges |= subs or ({target} & modules.keys())
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_a_cycle(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _a_cycle(graph, component: set[str]) -> list[str]:
    start = min(component)
    path, seen = [start], {start}
    while True:
        nxt = min(w for w in graph[path[-1]] if w in component)
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)




@pytest.mark.parametrize("namespaces", [("sp_harness", "sp_harness.reference", "sp_harness.cases")],
                         ids=["whole-tree"])
def test_no_import_cycles(namespaces):
    cycles = _cycles(_import_graph(namespaces))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_names_its_stage_first():
    wrong = []
    for path, _ in _engine_modules():
        rel = path.relative_to(ROOT / "harness")
        if rel.parts == ("__init__.py",):
            continue  # the package docstring: what sp-harness is
        stage = rel.parts[0] if len(rel.parts) > 1 else "top"
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not doc and path.name == "__init__.py" and not path.read_text().strip():
            continue  # an empty package marker
        if not doc.startswith(f"Stage: {stage}."):
            wrong.append(f"{rel}: {doc.splitlines()[0] if doc else '(no docstring)'!r} (folder: {stage})")
    assert not wrong, "\n".join(wrong)


def test_every_stage_is_a_folder_and_every_folder_a_stage():
    folders = {p.name for p in (ROOT / "harness").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(STAGES)


def test_the_architecture_page_lists_the_stages_in_the_codes_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)/` \|", text, flags=re.M)
    assert rows == list(STAGES), f"docs/architecture.md's stage table: {rows}, sp_harness.stages.STAGES: {STAGES}"


def test_no_two_modules_share_a_file_name_across_stages():
    # `memory.py` in two folders, or `sidebyside.py` beside `side_by_side.py`, hide which is which
    seen: dict[str, list[str]] = {}
    for path, _ in _engine_modules():
        if path.name != "__init__.py":
            seen.setdefault(path.stem.replace("_", ""), []).append(str(path.relative_to(ROOT / "harness")))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


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
