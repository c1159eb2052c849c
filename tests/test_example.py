"""The README's "verify your own SP implementation" example works as printed."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "my_case.py")


@pytest.mark.sp_case(f"{EXAMPLE}:MY_MLP", world_size=2)
def test_marker_runs_the_users_case(sp_result):
    assert sp_result.verdict == "PASS", sp_result.reason


@pytest.mark.exhaustive("the fast tier runs MY_MLP on 2 ranks through the marker above, and `sp-harness check` on a "
                        "case file given by a relative path in test_user_project's test_cli_runs_builtin_and_user_cases")
def test_cli_on_the_users_file():
    out = subprocess.run([sys.executable, "-m", "sp_harness.cli", "check", "--case", "examples/my_case.py:MY_MLP",
                          "--world-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


def test_users_case_uneven_split_is_caught(sp_check):
    # the same plan on 3 ranks: 8 tokens 3/3/2 and 64 columns 22/22/20 -> upstream failure, reported
    from sp_harness.config.check_config import CheckConfig

    res = sp_check(CheckConfig(case=f"{EXAMPLE}:MY_MLP", world_size=3))
    assert res.verdict == "FAIL" and res.error
