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
        """,
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("userproject")
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def _env(**extra) -> dict[str, str]:
    # nothing of this checkout or of the outer pytest run leaks in: sp_harness comes from the install
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PYTEST_")}
    return dict(env, **extra)


def _cli(project, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH=src stands in for the user's project being installed
    return subprocess.run([sys.executable, "-m", "sp_harness.cli", *args], cwd=project, capture_output=True,
                          text=True, timeout=180, env=_env(PYTHONPATH=str(project / "src")))


@pytest.mark.parametrize("case", ["seed-mlp", "spchecks/user_cases.py:USER_CASE"])
def test_cli_runs_builtin_and_user_cases_inside_the_project(project, case):
    out = _cli(project, "check", "--case", case, "--world-size", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


def test_users_pytest_runs_its_case_and_ours(project):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "test_user_sp.py"], cwd=project, capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout


@pytest.mark.parametrize("file, error", [("broken_syntax.py", "SyntaxError"),
                                         ("missing_import.py", "ModuleNotFoundError")])
def test_broken_case_file_is_a_one_line_usage_error(project, file, error):
    out = _cli(project, "check", "--case", f"spchecks/{file}:X", "--world-size", "2")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"case file spchecks/{file} could not be loaded: {error}" in lines[0]
