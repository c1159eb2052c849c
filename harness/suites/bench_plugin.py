"""Stage: suites. What a verified example costs a user's own test suite: a test file of N examples
of one case through the sp-harness pytest plugin (one warm pool shared by the file) against the
same N examples as N `sp-harness check` commands (a fresh interpreter and pool each).

  plugin_s     wall time of `pytest -q FILE` with N tests, each `sp_check(CheckConfig(...))`
  plugin_1_s   the same file with one test: the fixed cost (interpreter, plugin, pool start)
  cli_s        N `sp-harness check --case C --seed K` commands, one after the other

so a file of N examples costs about plugin_1_s + (N - 1) * marginal_s, where marginal_s =
(plugin_s - plugin_1_s) / (N - 1), against cli_s through the CLI. Each figure is one run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEST_FILE = '''import pytest

from sp_harness.config.check_config import CheckConfig


@pytest.mark.parametrize("seed", range({n}))
def test_example(sp_check, seed):
    res = sp_check(CheckConfig(case={case!r}, world_size={world_size}, seed=seed))
    assert res.verdict == "PASS", res.reason
'''


def _env() -> dict[str, str]:
    # a user's suite, not ours: none of the calling pytest's (or xdist worker's) settings
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SP_HARNESS_PROFILE"))}


def _timed(argv: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    run = subprocess.run(argv, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {run.returncode}: {(run.stdout + run.stderr)[-2000:]}")
    return time.perf_counter() - t0


def _pytest_file(case: str, n: int, world_size: int, folder: str) -> float:
    path = Path(folder) / f"test_user_{n}.py"
    path.write_text(TEST_FILE.format(n=n, case=case, world_size=world_size))
    return _timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path.name], folder)


def plugin_row(*, case: str = "seed-mlp", n: int = 4, world_size: int = 2) -> dict:
    """The plugin's cost for a file of `n` examples of `case` against the CLI's (see the module doc)."""
    if n < 2:
        raise ValueError(f"n({n}) must be >= 2: the marginal cost needs two file sizes")
    with tempfile.TemporaryDirectory(prefix="sp-harness-bench-plugin-") as folder:
        plugin_1_s = _pytest_file(case, 1, world_size, folder)
        plugin_s = _pytest_file(case, n, world_size, folder)
        cli_s = sum(_timed([sys.executable, "-m", "sp_harness.cli", "check", "--case", case, "--world-size",
                            str(world_size), "--seed", str(seed)], folder) for seed in range(n))
    marginal_s = (plugin_s - plugin_1_s) / (n - 1)
    return {"case": case, "n": n, "world_size": world_size, "plugin_s": plugin_s, "plugin_1_s": plugin_1_s,
            "marginal_s": marginal_s, "cli_s": cli_s, "cli_per_example_s": cli_s / n, "speedup": cli_s / plugin_s}


def format_plugin(row: dict) -> str:
    return "\n".join([
        f"(j) a user's test file of N verified examples ({row['case']}, {row['world_size']} ranks) through the pytest "
        "plugin (one warm pool for the file) vs the same N `sp-harness check` commands; one run each",
        f"  N={row['n']}: plugin {row['plugin_s']:.2f}s (N=1: {row['plugin_1_s']:.2f}s; each further example "
        f"{row['marginal_s']:.2f}s)  CLI {row['cli_s']:.2f}s ({row['cli_per_example_s']:.2f}s per example)  "
        f"plugin {row['speedup']:.1f}x faster"])
