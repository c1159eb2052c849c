"""Hypothesis shrinks a deliberately broken case to a minimal uneven config, and the printed
one-line repro reproduces it."""

import os
import re
import shlex

import pytest

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "shrink_demo.py")


def test_even_shard_bug_shrinks_to_minimal_uneven_config(monkeypatch, capsys, tier):
    # the user's pytest run, in this process: its own session and pools (forked from this
    # worker's warm zygote, where a fresh interpreter paid torch's import and a zygote's start).
    # pytest.main, not pytester: pytester drops the modules the run imported, and torch's
    # operator libraries cannot register twice when imported again
    monkeypatch.setenv("SP_DEMO_CASE", "mutant-sp-even-shard-positions")
    capsys.readouterr()
    # this run's tier: its conftest loads that tier's hypothesis profile, for the whole process
    ret = pytest.main([DEMO, "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--tier", tier])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert ret == pytest.ExitCode.TESTS_FAILED, out
    shards = re.search(r"seq_shards=\((\d+), (\d+)\)", out)
    assert shards, out[-3000:]
    sizes = tuple(map(int, shards.groups()))
    # minimal: two ranks, the smallest uneven split that moves a position offset
    assert len(set(sizes)) == 2 and sum(sizes) <= 3, sizes
    repro = re.search(r"repro: (sp-harness check .*)", out).group(1)
    assert "--seq-shards" in repro
    # the line as the user pastes it, through the CLI's own parser and command (its exit codes
    # from a real process have their test in test_engine)
    from sp_harness.cli import build_parser

    args = build_parser().parse_args(shlex.split(repro)[1:])
    capsys.readouterr()
    assert args.func(args) == 1, capsys.readouterr().out
