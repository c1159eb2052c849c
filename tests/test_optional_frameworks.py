"""Optional frameworks are independent (issue 61): a framework, or a module its cases need, missing
or broken makes only the cases that need it UNSUPPORTED, naming the module and the pip extra that
installs it, and every other case runs. Each test hides modules from a real `sp-harness` and from
every process it starts: a sitecustomize on PYTHONPATH, which the fork server, the ranks and their
reference processes inherit (the finding of a rank dying at warm-up was only visible there)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sp_harness.cases.frameworks import ALSO_NEEDED, EXTRAS, FRAMEWORK_CASES, import_problem
from sp_harness.cli import EXIT_OK

ROOT = Path(__file__).resolve().parent.parent

HIDER = '''
import importlib.abc
import importlib.machinery
import os
import sys

MISSING = {missing!r}
BROKEN = {broken!r}


def _under(name, modules):
    return any(name == m or name.startswith(m + ".") for m in modules)


class _Broken(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError(f"{{module.__name__}}'s import raised (a simulated broken install)")


class _Hiding:
    """The path finder, blind to MISSING (find_spec None, as for a package never installed, and
    no distribution either) and with BROKEN's import raising."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if _under(name, MISSING):
            return None
        if name in BROKEN:
            return importlib.machinery.ModuleSpec(name, _Broken(), is_package=True)
        return self.inner.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        hidden = {{m.split(".")[0].replace("_", "-") for m in MISSING}}
        return (d for d in self.inner.find_distributions(*args, **kwargs)
                if (d.metadata["Name"] or "").lower().replace("_", "-") not in hidden)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


sys.meta_path[:] = [_Hiding(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
# every process but the first (the CLI) leaves its pid: the rank processes were hidden from too,
# or, for a check that must start none, one was started
if os.environ.setdefault("HIDDEN_ROOT_PID", str(os.getpid())) != str(os.getpid()):
    with open(os.environ["HIDDEN_STARTED"], "a") as f:
        f.write(f"{{os.getpid()}}\\n")
'''


class Hidden:
    """`sp-harness` run where `missing` (dotted module names, their submodules with them) are not
    installed and importing any of `broken` raises RuntimeError."""

    def __init__(self, folder: Path, *, missing: tuple[str, ...] = (), broken: tuple[str, ...] = ()):
        self.folder = folder
        (folder / "site").mkdir(parents=True)
        (folder / "site" / "sitecustomize.py").write_text(HIDER.format(missing=missing, broken=broken))
        self.runs = 0

    def run(self, *args: str, python: bool = False) -> tuple[subprocess.CompletedProcess, list[str]]:
        """The command's result and the processes it started (`python`: `args` are a script and
        its arguments, not sp-harness's)."""
        self.runs += 1
        started = self.folder / f"started-{self.runs}"
        started.touch()
        env = {k: v for k, v in os.environ.items() if k != "HIDDEN_ROOT_PID"}
        env.update(HIDDEN_STARTED=str(started), PYTHONPATH=os.pathsep.join(
            [str(self.folder / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
        command = ["-c", *args] if python else ["-m", "sp_harness.cli", *args]
        res = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=600)
        return res, started.read_text().split()

    def run_each(self, *argvs: list[str]) -> tuple[list[subprocess.CompletedProcess], list[str]]:
        """Commands that start no rank, run one after another in one hidden process (each pays an
        interpreter and torch's import otherwise): their results, each with its own output (the
        process's own stderr added to each), and the processes they started."""
        script = textwrap.dedent("""
            import contextlib, io, json, sys
            from sp_harness.cli import main
            got = []
            for argv in json.loads(sys.argv[1]):
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = main(argv)
                got.append((code, out.getvalue(), err.getvalue()))
            print(json.dumps(got))
            """)
        res, started = self.run(script, json.dumps(argvs), python=True)
        assert res.returncode == 0, res.stdout + res.stderr[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        return [subprocess.CompletedProcess(argv, code, out, err + res.stderr)
                for argv, (code, out, err) in zip(argvs, got, strict=True)], started


def _listed(res: subprocess.CompletedProcess) -> dict[str, str]:
    assert res.returncode == EXIT_OK, res.stderr[-3000:]
    return {line.split()[0]: " ".join(line.split()[1:]) for line in res.stdout.splitlines() if line.strip()}


def _unsupported(hidden: Hidden, case: str, line: str, *flags: str,
                 res: subprocess.CompletedProcess | None = None, started: list[str] | None = None) -> None:
    """A check of `case` says `line` and exits as a declared UNSUPPORTED does (EXIT_OK: not a
    failure), with no process started (`res` and `started`: its result and the processes of the
    run it was part of, where it ran already)."""
    if res is None:
        res, started = hidden.run("check", "--case", case, *flags)
    assert f"UNSUPPORTED: {line}" in res.stdout.splitlines(), res.stdout + res.stderr[-3000:]
    assert res.returncode == EXIT_OK, res.stdout + res.stderr[-3000:]
    assert started == [], f"a check of {case} started processes {started}"


def _passes(hidden: Hidden, case: str, *flags: str) -> None:
    res, started = hidden.run("check", "--case", case, *flags)
    verdicts = [line for line in res.stdout.splitlines() if line.startswith(("PASS", "FAIL", "ERROR", "UNSUPPORTED"))]
    assert res.returncode == EXIT_OK and verdicts and verdicts[0].startswith("PASS ("), res.stdout + res.stderr[-3000:]
    assert started, "the rank processes started without the hiding: this test would prove nothing"


def test_without_transformers_and_with_megatron_broken_every_other_case_runs(tmp_path):
    # deepspeed installed without transformers: every check died at its ranks' warm-up, which
    # looked up every case (LookupError: ... 'ds-ulysses-hf-llama' ... registered no such case);
    # a megatron package whose import raises broke the same lookup by raising through find_spec
    hidden = Hidden(tmp_path, missing=("transformers",), broken=("megatron",))
    (res, checked), started = hidden.run_each(["list"], ["check", "--case", "ds-ulysses-hf-llama"])
    listed = _listed(res)
    no_transformers = "needs transformers, which is not installed"
    assert listed["ds-ulysses-hf-llama"] == f"case unavailable: {no_transformers} (pip install 'sp-harness[deepspeed]')"
    assert listed["mutant-ds-ulysses-hf-exchange-detached"].startswith(f"mutant unavailable: {no_transformers}")
    assert listed["hf-trainer-llama"] == f"case unavailable: {no_transformers} (pip install 'sp-harness[hf]')"
    assert listed["mcore-gpt-sp"].startswith("case unavailable: needs megatron.core, whose import fails (RuntimeError: ")
    assert listed["mcore-gpt-sp"].endswith("(pip install 'sp-harness[megatron]')")
    runnable = ("megatron-gpt-sp", "ds-ulysses", "ds-ulysses-step", "titan-llama3-sp", "yc-usp")
    assert not [name for name in runnable if "unavailable" in listed[name]], listed

    _unsupported(hidden, "ds-ulysses-hf-llama",
                 f"case ds-ulysses-hf-llama {no_transformers} (pip install 'sp-harness[deepspeed]')",
                 res=checked, started=started)
    _passes(hidden, "megatron-gpt-sp", "--world-size", "2", "--no-compare-comm")


@pytest.mark.exhaustive("a second hidden environment; the fast tier hides transformers and breaks megatron, which "
                        "take the same registry path (listed, UNSUPPORTED naming the extra, no process started)")
def test_without_deepspeed_its_cases_are_listed_and_unsupported_naming_its_extra(tmp_path):
    # before, a missing framework's cases were not listed at all, and a check of one was an
    # unknown case (exit 2)
    hidden = Hidden(tmp_path, missing=("deepspeed",))
    res, _ = hidden.run("list")
    listed = _listed(res)
    why = "needs deepspeed, which is not installed (pip install 'sp-harness[deepspeed]')"
    ds = [name for name in listed if name.startswith(("ds-", "mutant-ds-"))]
    assert len(ds) > 20 and all(listed[name].endswith(f"unavailable: {why}") for name in ds), listed
    assert "unavailable" not in listed["hf-trainer-llama"] + listed["mcore-gpt-sp"]
    # the training-step check's own requirements come after the case's: it is UNSUPPORTED too
    _unsupported(hidden, "ds-ulysses-step", f"case ds-ulysses-step {why}", "--train-step")


@pytest.mark.exhaustive("the fast tier runs a case on ranks with transformers hidden; deepspeed's absence "
                        "reaches the ranks by the same registry path")
def test_without_deepspeed_a_case_needing_no_framework_passes_on_ranks(tmp_path):
    hidden = Hidden(tmp_path, missing=("deepspeed",))
    _passes(hidden, "megatron-gpt-sp", "--world-size", "2", "--no-compare-comm")
    _unsupported(hidden, "ds-ulysses", "case ds-ulysses needs deepspeed, which is not installed "
                                       "(pip install 'sp-harness[deepspeed]')")


def test_every_framework_names_its_extra_and_every_other_need_names_real_cases():
    # a need naming no case, or a framework without its extra, would leave cases runnable where
    # they cannot run (a setup error on their ranks) or an UNSUPPORTED line with no way to fix it
    extras = set(re.findall(r"^([a-z]+) = \[", (ROOT / "pyproject.toml").read_text(), re.MULTILINE))
    assert set(EXTRAS) == set(FRAMEWORK_CASES) and set(EXTRAS.values()) <= extras, (EXTRAS, extras)
    names = {name for _, cases in FRAMEWORK_CASES.values() for name in cases}
    assert {module: sorted(set(cases) - names) for module, cases in ALSO_NEEDED.items()} == {m: [] for m in ALSO_NEEDED}


class _Raising:
    """A meta-path finder under which finding `name` raises `exc` (a broken install's import)."""

    def __init__(self, name: str, exc: Exception):
        self.name, self.exc = name, exc

    def find_spec(self, name, path=None, target=None):
        if name == self.name:
            raise self.exc
        return None


@pytest.mark.parametrize("exc,problem", [
    (ModuleNotFoundError("No module named 'sp_harness_demo_pkg'", name="sp_harness_demo_pkg"), "which is not installed"),
    (ModuleNotFoundError("No module named 'its_dep'", name="its_dep"),
     "whose import fails (ModuleNotFoundError: No module named 'its_dep')"),
    (ImportError("cannot import name 'x'"), "whose import fails (ImportError: cannot import name 'x')"),
    (OSError("libfoo.so: cannot open shared object file"), "whose import fails (OSError: libfoo.so: cannot open "
                                                           "shared object file)"),
])
def test_a_module_is_missing_only_where_it_is_the_one_not_found(monkeypatch, exc, problem):
    # a package whose own dependency is missing is installed but broken: its extra's install is
    # what fixes either, and the line says which it is
    monkeypatch.setattr(sys, "meta_path", [_Raising("sp_harness_demo_pkg", exc), *sys.meta_path])
    assert import_problem("sp_harness_demo_pkg") == problem
    assert import_problem("sp_harness_demo_pkg.core") == problem  # through its parent package
    assert import_problem("sp_harness_no_such_package") == "which is not installed"


@pytest.mark.exhaustive("it starts ranks (12-45 s); the fast tier runs the broken-megatron lookup, found before "
                        "any rank starts, and test_verdicts' unit test of the preload's Unsupported")
def test_a_framework_found_but_broken_at_import_is_unsupported_on_its_ranks(tmp_path):
    # found without being imported, it is listed as runnable; its ranks' preload imports it, and
    # the raise there is the case's UNSUPPORTED (naming the module), not an ERROR of the check
    hidden = Hidden(tmp_path, broken=("transformers",))
    res, started = hidden.run("check", "--case", "ds-ulysses-hf-llama", "--world-size", "2", "--no-compare-comm")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(("PASS", "FAIL", "ERROR", "UNSUPPORTED"))), "")
    assert line.startswith("UNSUPPORTED: case ds-ulysses-hf-llama needs transformers"), res.stdout + res.stderr[-3000:]
    assert "whose import fails here (RuntimeError: transformers's import raised" in line, line
    assert res.returncode == EXIT_OK and started, res.stdout
