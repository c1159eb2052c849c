"""A user's project cannot collide with ours: it has its own top-level `cases`, `reference` and
`harness` packages (the names of our source folders), a src layout, and a case file importing a
helper beside it, its own src package and its own `cases`. Our built-in cases and the user's
case must both run, from the CLI and from the user's pytest, on real ranks; a broken case file is
a usage error (exit 2, one line), not a traceback."""

import os
import subprocess
import sys
import textwrap

import pytest

FILES = {
    "cases/__init__.py": 'MARKER = "the user\'s own cases package"\n',
    "reference/__init__.py": "def scale():\n    return 0.5\n",
    "harness/__init__.py": "HIDDEN = 24\n",
    "src/userpkg/__init__.py": """
        import torch


        class MLP(torch.nn.Module):
            def __init__(self, width, hidden):
                super().__init__()
                self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

            def forward(self, x):
                return self.down(torch.relu(self.up(x)))
        """,
    "pytest.ini": "[pytest]\npythonpath = src\n",
    "spchecks/user_helpers.py": """
        import torch

        from cases import MARKER  # the project's own `cases`, on the ranks too
        from harness import HIDDEN
        from reference import scale

        assert MARKER == "the user's own cases package", MARKER
        WIDTH = 16


        def make_batch(cfg, step, gen):
            x = torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
            return x * scale(), torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
        """,
    "spchecks/user_cases.py": """
        import torch
        from user_helpers import HIDDEN, WIDTH, make_batch  # beside this file, not on any path
        from userpkg import MLP  # the src layout

        from sp_harness import Case, Layout, Sharded


        def reference(cfg):
            torch.manual_seed(cfg.seed)
            return MLP(WIDTH, cfg.hidden).double()


        def shard(model, ctx):
            # replicated: every rank runs the whole model on the whole sequence
            layout = Layout(seq_dim=0, seq_sharded=False)
            return Sharded(module=model, input_layout=layout, output_layout=layout, replicated=("*",))


        USER_CASE = Case(name="user-mlp", description="the user's replicated MLP", build_reference=reference,
                         make_batch=make_batch, shard=shard, loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(),
                         tokens=lambda tgt: tgt.shape[0], defaults=dict(seq_len=8, hidden=HIDDEN))
        """,
    # issue 21: a project laid out as myproj/cases + myproj/mysp, its case file importing a
    # sibling package through the project's root (found by its pyproject.toml), no PYTHONPATH
    "nested/pyproject.toml": "[project]\nname = 'myproj'\nversion = '0'\n",
    "nested/myproj/__init__.py": "",
    "nested/myproj/mysp/__init__.py": "WIDTH = 16\n",
    "nested/myproj/cases/sp_cases.py": """
        import torch
        from myproj.mysp import WIDTH

        from sp_harness import Case, Layout, Sharded


        def reference(cfg):
            torch.manual_seed(cfg.seed)
            return torch.nn.Linear(WIDTH, WIDTH).double()


        def shard(model, ctx):
            layout = Layout(seq_dim=0, seq_sharded=False)
            return Sharded(module=model, input_layout=layout, output_layout=layout, replicated=("*",))


        def make_batch(cfg, step, gen):
            x = torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
            return x, torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)


        NESTED = Case(name="nested", description="imports its project's sibling package", build_reference=reference,
                      make_batch=make_batch, shard=shard, loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(),
                      tokens=lambda tgt: tgt.shape[0], defaults=dict(seq_len=8))
        """,
    "nested/myproj/cases/missing_sibling.py": "from myproj.not_there import X\n",
    "spchecks/erroring.py": """
        import torch

        from sp_harness import Case


        def shard(model, ctx):
            raise ValueError("my shard() is broken")


        ERRORING = Case(name="erroring", description="a shard() that raises", shard=shard,
                        build_reference=lambda cfg: torch.nn.Linear(4, 4).double(),
                        make_batch=lambda cfg, step, gen: (torch.randn(cfg.seq_len, 4, dtype=torch.float64),) * 2,
                        loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(), tokens=lambda tgt: tgt.shape[0],
                        defaults=dict(seq_len=8))
        """,
    "test_user_error.py": """
        import pytest


        @pytest.mark.sp_case("spchecks/erroring.py:ERRORING", world_size=2)
        def test_erroring_case(sp_result):
            assert sp_result.verdict == "PASS"
        """,
    "spchecks/broken_syntax.py": "from sp_harness import Case\n\ndef shard(model, ctx:\n    return model\n",
    "spchecks/missing_import.py": "import sp_harness_user_dependency_not_installed\n",
    "test_user_sp.py": """
        import pytest

        import cases
        import harness


        def test_the_projects_own_packages_are_its_own():
            assert cases.MARKER == "the user's own cases package" and harness.HIDDEN == 24


        @pytest.mark.sp_case("spchecks/user_cases.py:USER_CASE", world_size=2)
        def test_users_case(sp_result):
            assert sp_result.verdict == "PASS", sp_result.reason + sp_result.error


        @pytest.mark.sp_case("seed-mlp", world_size=2)
        def test_builtin_case(sp_result):
            assert sp_result.verdict == "PASS", sp_result.reason + sp_result.error


        # a project of its own below this one, its root not the current directory nor on any
        # path: found by its pyproject.toml, in the ranks too
        @pytest.mark.sp_case("nested/myproj/cases/sp_cases.py:NESTED", world_size=2)
        def test_nested_projects_case(sp_result):
            assert sp_result.verdict == "PASS", sp_result.reason + sp_result.error
        """,
    # test_isolation's claim, on this run's interpreter: through the plugin each case gets its
    # standalone verdict, whatever ran before it (a mutant patching torch in its ranks, its twin)
    "test_user_isolation.py": """
        from sp_harness import CheckConfig

        CASES = ISOLATION_CASES


        def test_each_case_gets_its_standalone_verdict(sp_check):
            # the twin after the patcher, and the patcher after the twin
            got = [sp_check(CheckConfig(case=f"{CASES}:{name}", world_size=2)).verdict
                   for name in ("PATCHING", "TWIN", "PATCHING")]
            assert got == ["FAIL", "PASS", "FAIL"], got
        """,
}
ISOLATION_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isolation_cases.py")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("userproject")
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip().replace("ISOLATION_CASES", repr(ISOLATION_CASES)))
    return root


def _env(**extra) -> dict[str, str]:
    # nothing of this checkout or of the outer pytest run leaks in: sp_harness comes from the install
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PYTEST_")}
    return dict(env, **extra)


def _cli(project, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH=src stands in for the user's project being installed
    return subprocess.run([sys.executable, "-m", "sp_harness.cli", *args], cwd=project, capture_output=True,
                          text=True, timeout=180, env=_env(PYTHONPATH=str(project / "src")))


@pytest.mark.parametrize("case", [pytest.param("seed-mlp", marks=pytest.mark.exhaustive(
    "the fast tier runs the user's case here, and built-in cases through the CLI in test_cli_errors and test_engine")),
    "spchecks/user_cases.py:USER_CASE"])
def test_cli_runs_builtin_and_user_cases_inside_the_project(project, case):
    out = _cli(project, "check", "--case", case, "--world-size", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


def test_users_pytest_runs_its_case_and_ours(project):
    # and its nested project's case, importing a sibling package through that project's root
    # (no PYTHONPATH); test_isolation's cases each get their standalone verdict; and a case whose
    # shard() raises is pytest's error (the check could not run), not a failure
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "test_user_sp.py", "test_user_isolation.py", "test_user_error.py"], cwd=project,
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 1, out.stdout + out.stderr
    assert "5 passed, 1 error" in out.stdout, out.stdout
    assert "ERROR at setup of test_erroring_case" in out.stdout and "my shard() is broken" in out.stdout


@pytest.fixture(scope="module")
def usage_errors(project) -> dict[str, tuple[int, str]]:
    """What `sp-harness check` returns and writes to stderr for each broken case file, all in one
    process (each pays an interpreter and torch's import otherwise) that must write nothing
    else to its stderr: {case: (exit code, stderr)}."""
    import json

    script = textwrap.dedent("""
        import contextlib, io, json, sys
        from sp_harness.cli import main
        out = {}
        for case in json.loads(sys.argv[1]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                out[case] = (main(["check", "--case", case, "--world-size", "2"]), err.getvalue())
        print(json.dumps(out))
        """)
    cases = ["spchecks/broken_syntax.py:X", "spchecks/missing_import.py:X", "nested/myproj/cases/missing_sibling.py:X"]
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=project, capture_output=True,
                         text=True, timeout=180, env=_env(PYTHONPATH=str(project / "src")))
    assert run.returncode == 0 and run.stderr == "", run.stdout + run.stderr
    return {case: tuple(got) for case, got in json.loads(run.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("file, error", [("broken_syntax.py", "SyntaxError"),
                                         ("missing_import.py", "ModuleNotFoundError")])
def test_broken_case_file_is_a_one_line_usage_error(usage_errors, file, error):
    code, stderr = usage_errors[f"spchecks/{file}:X"]
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert f"case file spchecks/{file} could not be loaded: {error}" in lines[0]


@pytest.mark.exhaustive("the fast tier runs the nested project's case, imports through its root found by its "
                        "pyproject.toml, through the user's pytest: test_users_pytest_runs_its_case_and_ours")
def test_case_file_imports_its_projects_sibling_packages_from_another_directory(project, tmp_path):
    # run from elsewhere, without PYTHONPATH: the project root comes from its pyproject.toml
    out = subprocess.run([sys.executable, "-m", "sp_harness.cli", "check", "--case",
                          f"{project / 'nested/myproj/cases/sp_cases.py'}:NESTED", "--world-size", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


def test_failed_import_says_what_was_importable(project, usage_errors):
    code, stderr = usage_errors["nested/myproj/cases/missing_sibling.py:X"]
    assert code == 2, stderr
    line = stderr.strip()
    assert len(line.splitlines()) == 1, stderr
    assert "ModuleNotFoundError" in line and str(project / "nested") in line and "PYTHONPATH" in line, line
