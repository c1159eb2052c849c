"""A verdict means what it says (issue 61): ERROR for a check that could not run (a crash before
the code under test's first step), its own exit code and JSON status; FAIL only for the code's
own defects; `--also` accumulates, and a check it asks for that is not run is named."""

from __future__ import annotations

import json
import os
import sys

import pytest

from sp_harness.checks import Outcome
from sp_harness.cli import EXIT_ERROR, EXIT_FAIL, EXIT_OK, _check_names, build_parser, exit_code
from sp_harness.launch.failure import RankError, RankFailure
from sp_harness.launch.wire import STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTY = "tests/faulty_cases.py"


@pytest.mark.parametrize("argv", [["--also", "lockstep", "--also", "accumulation-invariance"],
                                  ["--also", "lockstep", "accumulation-invariance"]])
def test_also_accumulates_repeated_and_space_separated(argv):
    args = build_parser().parse_args(["check", "--case", "seed-mlp", *argv])
    assert _check_names(args)[-2:] == ["lockstep", "accumulation-invariance"]


def test_exit_codes_rank_fail_over_error_over_ok():
    def outcome(status):
        return Outcome(check="x", status=status)

    assert exit_code([outcome("pass"), outcome("n/a")]) == EXIT_OK
    assert exit_code([outcome("error"), outcome("n/a")]) == EXIT_ERROR
    assert exit_code([outcome("error"), outcome("fail")]) == EXIT_FAIL
    assert len({EXIT_OK, EXIT_FAIL, 2, EXIT_ERROR}) == 4


@pytest.mark.parametrize("kind", ["raised", "exited", "signal"])
def test_a_crash_is_setup_only_before_the_steps(kind):
    def failure(phase):
        return RankFailure("case x", [RankError(rank=1, kind=kind, exc_type="ValueError", phase=phase)])

    assert failure("shard()").in_setup and failure("building the reference").in_setup
    assert not failure(STEPS).in_setup
    assert not failure("").in_setup  # a job that marks no phase is never judged to be setting up


@pytest.mark.parametrize("kind", ["timeout", "desync"])
def test_a_hang_or_desync_in_setup_stays_the_codes_own(kind):
    assert not RankFailure("case x", [RankError(rank=0, kind=kind, phase="shard()")], timeout_s=5).in_setup


def test_cli_error_verdict_its_exit_code_json_and_the_skipped_checks(tmp_path, capsys):
    # the CLI's parser and command in this process (its ranks on this worker's default pools): a
    # fresh interpreter paid 3-5 s of imports; the exit status of a real process whose setup
    # crashed (3, ERROR) is test_isolation's test_a_failing_setup_is_the_verdict_error_exit_3
    out_json = tmp_path / "verdict.json"
    args = build_parser().parse_args(["check", "--case", os.path.join(ROOT, FAULTY) + ":RAISING", "--world-size", "2",
                                      "--also", "lockstep", "--json", str(out_json)])
    capsys.readouterr()
    code = args.func(args)
    stdout = capsys.readouterr().out
    assert code == EXIT_ERROR, stdout
    error_lines = [ln for ln in stdout.splitlines() if ln.startswith("ERROR: ")]
    assert len(error_lines) == 1, stdout
    assert "rank 1 raised RuntimeError while setting up (shard()): boom on purpose in rank 1" in error_lines[0]
    assert "FAIL" not in stdout
    # the checks asked for after it are named as skipped, with why, in the text and the JSON
    assert "lockstep: skipped: the side-by-side check did not pass (ERROR)" in stdout, stdout
    doc = json.loads(out_json.read_text())
    rows = {o["check"]: o for o in doc["outcomes"]}
    assert rows["side-by-side"]["status"] == "error" and rows["side-by-side"]["figures"]["verdict"] == "ERROR"
    assert rows["lockstep"]["status"] == "n/a" and rows["lockstep"]["skipped"] is True
    assert doc["schema_version"] == 2


def _failed(grad_factor):
    from sp_harness.compare.tensor_check import TensorCheck
    from sp_harness.config.check_config import CheckConfig
    from sp_harness.judge.verdict import RankResult, merge, record

    result = RankResult(rank=0)
    record(result, TensorCheck(kind="grad", name="w", step=0, rank=0, max_abs=1.0, max_rel=1.0, allowed=0.5,
                               ratio=2.0, worst_index=(0,), got=1.0, want=2.0, ok=False))
    result.grad_factor = grad_factor
    return merge(CheckConfig(case="seed-mlp", world_size=2, steps=1), [result])


def test_the_report_prints_the_uniform_grad_factor_the_json_knows():
    from sp_harness.report.result_text import format_result

    text = format_result(_failed(0.334))
    assert "every param grad is 0.334x the reference's" in text
    assert _failed(0.334).to_json()["grad_factor"] == 0.334
    assert "every param grad" not in format_result(_failed(None))  # no uniform fit: nothing said


def test_the_table_states_what_its_ratio_column_means():
    from sp_harness.report.result_text import RATIO_LEGEND, format_result

    assert RATIO_LEGEND in format_result(_failed(None)).splitlines()


class _BrokenModule:
    """A meta-path finder under which importing `name` raises, as a broken install's import does."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path=None, target=None):
        if name == self.name:
            raise RuntimeError(f"{name}'s import raised")
        return None


def test_a_preload_broken_at_import_is_the_cases_unsupported(monkeypatch):
    from sp_harness.config.case import Unsupported
    from sp_harness.launch.case_setup import load_preload

    module = "megatron.core.sp_harness_broken_demo"
    monkeypatch.setattr(sys, "meta_path", [_BrokenModule(module), *sys.meta_path])
    with pytest.raises(Unsupported, match=rf"needs {module}, whose import fails here \(RuntimeError: "
                                          rf"{module}'s import raised\) \(pip install 'sp-harness\[megatron\]'\)"):
        load_preload([module])


def test_a_factor_near_one_is_not_offered_as_an_explanation():
    from sp_harness.checks.train_step_rank import UNIFORM_FIT, uniform_factor

    def sums(factor, noise=0.0):  # got = factor * want + noise (orthogonal), |want| = 1
        return factor, 1.0, factor * factor + noise * noise

    assert uniform_factor(*sums(0.5)) == 0.5 and uniform_factor(*sums(2.0, noise=0.01)) == 2.0
    assert uniform_factor(*sums(1.0 + UNIFORM_FIT / 2)) is None  # within the fit's tolerance of 1
    assert uniform_factor(*sums(1.0, noise=0.001)) is None
    assert uniform_factor(*sums(0.5, noise=0.5)) is None  # no one factor fits
