"""Exit codes mean one thing each (issue 13): 2 is a usage or setup error, reported as one line
naming the value and what is valid, before any rank starts; 1 is a FAIL verdict; 0 verdicts as
expected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# One interpreter runs every usage error of the table in turn, as `python -m sp_harness.cli` would
# (its exit status is `main`'s return value; an exception escaping `main` is a traceback, exit 1):
# each fresh interpreter cost 3-5 s of importing torch for a check that takes milliseconds.
_BATCH = """
import contextlib, io, json, sys, traceback
from sp_harness.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


def _run_each(argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    import json

    env = dict(os.environ)
    env.pop("SP_HARNESS_MAX_WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(argvs)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == len(argvs), proc.stdout + proc.stderr
    return [subprocess.CompletedProcess(argv, *json.loads(line)) for argv, line in zip(argvs, lines, strict=True)]


def _one_line_usage_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    # nothing ran: no verdict was printed
    assert "PASS" not in proc.stdout and "FAIL" not in proc.stdout


USAGE_ERRORS = [
    (["check", "--case", "nope"], ["'nope'", "known cases"]),
    # issue 21: sizes that cannot fit are a setup error before ranks start, not a FAIL
    (["check", "--case", "megatron-gpt-sp", "--hidden", "100000", "--seq-len", "100000"],
     ["needs at least", "GiB in one reference process", "this machine has"]),
    (["check", "--case", "seed-mlp", "--timeout", "nan"], ["timeout_s", "nan"]),
    (["check", "--case", "seed-mlp", "--lr", "inf"], ["lr", "inf"]),
    (["check", "--case", "ring-gpt", "--seq-len", "8", "--prompt-len", "8"], ["prompt_len(8)", "seq_len(8)"]),
    (["check", "--case", "seed-mlp", "--world-size", "1000"], ["1000", "at most"]),
    (["check", "--case", "seed-mlp", "--world-size", "3", "--seq-shards", "4,4"], ["seq_shards", "tp=3"]),
    (["check", "--case", "seed-mlp", "--json", "/proc/nope/v.json"], ["/proc/nope/v.json", "cannot be written"]),
    (["check", "--case", "seed-mlp", "--also", "no-such-check"], ["no-such-check", "checks:"]),
    (["check", "--case", "no_such_file.py:CASE"], ["no_such_file.py"]),
    (["nightly", "--case", "nope", "--out", "/tmp"], ["'nope'", "known cases"]),
    (["converge", "--case", "seed-mlp", "--out", "/proc/nope/run"], ["/proc/nope/run", "cannot be written"]),
    # a folder that root may "access" but no one can make entries in (its runs folder): was a traceback, exit 1
    (["converge", "--case", "seed-mlp", "--out", "/proc/nope"], ["/proc/nope", "cannot be written"]),
    (["converge", "--case", "megatron-gpt-sp", "--world-size", "1000"], ["1000", "at most"]),
    (["converge", "--case", "megatron-gpt-sp", "--world-size", "3", "--baseline", "nope"], ["'nope'"]),
]


# The file's other runs go to the same interpreter, after the table: two more usage errors (their
# folders from tmp_path_factory), then the two that start ranks, last, so every usage error is
# asked of an interpreter where no rank has started. Each was a process of its own (3-7 s each);
# exit codes from a real process: a setup crash's 3 in test_verdicts and test_isolation, Ctrl-C's
# and SIGTERM's in test_engine and test_converge.
FAIL_ARGV = ["check", "--case", "mutant-sp-local-positions", "--world-size", "2", "--no-compare-comm"]
UNSUPPORTED_ARGV = ["check", "--case", "dtensor-gpt", "--world-size", "3"]


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """{name: (folder, CompletedProcess)} for the table (`usage`, one per row) and the file's other
    runs, from one interpreter."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "out").mkdir()
    named = {"cannot-fit": ["converge", "--seq-len", "300000", "--out", str(folder / "out" / "run")],
             "json-directory": ["check", "--case", "seed-mlp", "--json", str(folder)],
             "no-record-file": ["releases", "--table", str(folder / "none.jsonl")],
             "fail": FAIL_ARGV, "unsupported": UNSUPPORTED_ARGV}
    procs = _run_each([argv for argv, _ in USAGE_ERRORS] + list(named.values()))
    usage, rest = procs[:len(USAGE_ERRORS)], procs[len(USAGE_ERRORS):]
    return folder, {"usage": usage, **dict(zip(named, rest, strict=True))}


def test_usage_errors_exit_2_with_one_line_before_any_rank(batch):
    _, runs = batch
    failures = []
    for (argv, needles), proc in zip(USAGE_ERRORS, runs["usage"], strict=True):
        try:
            _one_line_usage_error(proc, *needles)
        except AssertionError as exc:
            failures.append(f"{' '.join(argv)}: {exc}")
    assert not failures, "\n".join(failures)


def test_a_converge_that_cannot_fit_is_a_usage_error_leaving_no_report(batch):
    folder, runs = batch
    _one_line_usage_error(runs["cannot-fit"], "needs at least", "this machine has")
    assert not any((folder / "out").glob("*"))


def test_a_directory_as_json_output_is_a_usage_error(batch):
    folder, runs = batch
    _one_line_usage_error(runs["json-directory"], str(folder))


def test_the_releases_command_refuses_a_missing_record_file(batch):
    folder, runs = batch
    proc = runs["no-record-file"]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"sp-harness: error: --table: no such record file {folder / 'none.jsonl'} "
                                   "(sp-harness releases --out FILE writes one)")


def _ran(batch, argv: list[str]) -> subprocess.CompletedProcess:
    """The batch's run of `argv` (written out in each test: tests/test_tiers reads a test's
    literals for the cases it exercises)."""
    runs = [proc for proc in batch[1].values() if isinstance(proc, subprocess.CompletedProcess) and proc.args == argv]
    assert runs, f"the batch ran no {argv} (FAIL_ARGV, UNSUPPORTED_ARGV)"
    return runs[0]


def test_a_fail_verdict_exits_1_and_an_upstream_pin_is_still_a_fail(batch):
    proc = _ran(batch, ["check", "--case", "mutant-sp-local-positions", "--world-size", "2", "--no-compare-comm"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "repro: sp-harness check" in proc.stdout


def test_unsupported_exits_0(batch):
    proc = _ran(batch, ["check", "--case", "dtensor-gpt", "--world-size", "3"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "UNSUPPORTED" in proc.stdout


def test_every_option_of_every_command_has_help():
    import argparse

    from sp_harness.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = {name: [a.dest for a in p._actions if not a.help and not isinstance(a, argparse._HelpAction)]
            for name, p in sub.choices.items()}
    assert not any(bare.values()), {k: v for k, v in bare.items() if v}


def test_a_gpu_machines_pools_are_limited_by_its_cores_not_its_gpus(monkeypatch):
    # found on an H100 (one GPU): the CLI refused --world-size 2 ("at most 1") though its pools
    # run gloo ranks on the CPU; one GPU per rank is nccl's limit only
    import torch

    from sp_harness.launch import runner

    monkeypatch.delenv("SP_HARNESS_MAX_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runner.runner_backend() == "gloo"
    assert runner.max_world_size() >= 8
    runner.check_world_size(4)
    assert runner.max_world_size("nccl") == 1


def test_a_pytest_worker_gets_nccl_only_with_two_gpus_of_its_own(monkeypatch):
    # one GPU hosts one nccl rank: a worker with fewer than two runs its ranks on gloo (CPU)
    import torch

    from sp_harness.pytest_plugin import _pool_options

    monkeypatch.delenv("SP_HARNESS_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, workers, worker, want in [(1, 1, "gw0", ("gloo", None)), (4, 2, "gw1", ("nccl", (1, 3))),
                                         (2, 2, "gw0", ("gloo", None)), (8, 1, "gw0", ("nccl", tuple(range(8))))]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        got = _pool_options(None)
        assert (got.backend, got.devices) == want, (count, workers, worker)
    monkeypatch.setenv("SP_HARNESS_BACKEND", "gloo")
    assert _pool_options(None).backend == "gloo"
