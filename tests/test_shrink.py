"""Hypothesis shrinks a deliberately broken case to a minimal uneven config, and the printed
one-line repro reproduces it."""

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_even_shard_bug_shrinks_to_minimal_uneven_config():
    env = dict(os.environ, SP_DEMO_CASE="mutant-sp-even-shard-positions", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/demo/shrink_demo.py", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-q"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    shards = re.search(r"seq_shards=\((\d+), (\d+)\)", out)
    assert shards, out[-3000:]
    sizes = tuple(map(int, shards.groups()))
    # minimal: two ranks, the smallest uneven split that moves a position offset
    assert len(set(sizes)) == 2 and sum(sizes) <= 3, sizes
    repro = re.search(r"repro: (sp-harness check .*)", out).group(1)
    assert "--seq-shards" in repro
    again = subprocess.run([sys.executable, "-m", "sp_harness.cli", *shlex.split(repro)[1:]], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1, again.stdout + again.stderr
