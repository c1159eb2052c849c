"""Stage: top. The sp-harness pytest plugin, loaded by entry point.

- options (group "sp-harness", each with an ini key and an env mirror):
  --sp-timeout / sp_timeout / SP_HARNESS_TIMEOUT: seconds per job before it counts as hung;
  --sp-max-world-size / sp_max_world_size / SP_HARNESS_MAX_WORLD_SIZE: largest pool to start;
  --sp-max-pools / sp_max_pools / SP_HARNESS_MAX_POOLS: pools kept warm per xdist worker.
- hypothesis profiles `sp-harness-dev`, `-ci`, `-nightly`, `-replay` (sp_harness.config.profiles):
  registered, never loaded here; a project's own conftest loads one (`profiles.load_default()`).
The plugin changes nothing for tests that do not use it: no hypothesis profile loaded, no
environment variable set, torch imported only by its fixtures.
- fixtures: `sp_pool` (the worker's PoolManager, in the session stash), `sp_check(config)`, and
  `sp_result` for tests marked `@pytest.mark.sp_case("case-or-file.py:NAME", **config_fields)`;
  an ERROR verdict (the check could not run) is a pytest error in the fixture, not a failure.
Each xdist worker owns its pools (own processes, OS-chosen ports); with GPUs, workers split the
visible devices between them.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import pytest

from sp_harness.config import profiles  # noqa: F401  (registers, never loads, the hypothesis profiles)

if TYPE_CHECKING:
    from sp_harness.launch.manager import PoolManager  # imports torch: only where a fixture needs it

POOL_KEY: pytest.StashKey[PoolManager] = pytest.StashKey()
OPTIONS = {
    # name: (type, default, help)
    "sp_timeout": (float, 120.0, "seconds per job before it counts as hung (generous: CI runners are loaded)"),
    "sp_max_world_size": (int, 4, "largest world size the tests may start"),
    "sp_max_pools": (int, 4, "pools (one per world size) kept warm per xdist worker"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sp-harness", "sequence-parallel verification harness")
    for name, (typ, default, help_text) in OPTIONS.items():
        env = "SP_HARNESS_" + name[3:].upper()
        group.addoption("--" + name.replace("_", "-"), type=typ, default=None, dest=name,
                        help=f"{help_text} (ini {name}, env {env}, default {default})")
        parser.addini(name, help=help_text, default=None)


def option(config: pytest.Config, name: str):
    typ, default, _ = OPTIONS[name]
    value = config.getoption(name)
    if value is None:
        value = os.environ.get("SP_HARNESS_" + name[3:].upper()) or config.getini(name) or default
    try:
        return typ(value)
    except ValueError:
        raise pytest.UsageError(f"{name} must be a {typ.__name__}, got {value!r}") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sp_case(case, **fields): run this sp-harness case; the test gets `sp_result`")
    from sp_harness.config.timeouts import set_session_timeout

    # every check a test runs (the battery's too) resolves its timeout from here, unless it sets one
    set_session_timeout(option(config, "sp_timeout"))


def _pool_options(config: pytest.Config):
    import torch

    from sp_harness.launch.wire import PoolOptions

    if os.environ.get("SP_HARNESS_BACKEND", "") != "gloo" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        index = int(worker[2:]) if worker.startswith("gw") else 0
        mine = tuple(range(count))[index::num_workers]
        if len(mine) >= 2:  # one GPU cannot host two nccl ranks: with fewer, CPU ranks on gloo
            return PoolOptions(backend="nccl", devices=mine)
    return PoolOptions()


@pytest.fixture(scope="session")
def sp_pool(request: pytest.FixtureRequest):
    from sp_harness.launch.manager import PoolManager

    config = request.config
    if POOL_KEY not in config.stash:
        config.stash[POOL_KEY] = PoolManager(_pool_options(config), max_pools=option(config, "sp_max_pools"))
    return config.stash[POOL_KEY]


@pytest.fixture(scope="session")
def sp_max_world_size(request: pytest.FixtureRequest) -> int:
    limit = option(request.config, "sp_max_world_size")
    devices = _pool_options(request.config).devices
    return min(limit, len(devices)) if devices else limit


@pytest.fixture
def sp_check(sp_pool, request: pytest.FixtureRequest):
    """sp_check(config) -> CheckResult, run on this worker's warm pool with the suite's timeout: the
    side-by-side check, or the training-step check for a config with `train_step=True`."""
    from sp_harness.checks import side_by_side, train_step

    def run(config):
        check = train_step.check if config.train_step else side_by_side.check
        return check(config, sp_pool)  # a config without its own timeout takes the suite's

    return run


@pytest.fixture
def sp_result(request: pytest.FixtureRequest, sp_check):
    from sp_harness.config.check_config import CheckConfig

    marker = request.node.get_closest_marker("sp_case")
    if marker is None or not marker.args:
        raise pytest.UsageError("sp_result needs @pytest.mark.sp_case('case-name', **config_fields)")
    from sp_harness.judge.verdict import ERROR

    result = sp_check(CheckConfig(case=marker.args[0], **marker.kwargs))
    if result.verdict == ERROR:
        # pytest's own distinction: a setup that could not run is an error, not a failure
        pytest.fail(f"sp-harness ERROR: {result.reason}", pytrace=False)
    return result


@pytest.hookimpl(trylast=True)  # after session-scoped fixtures' teardown, which may still run jobs
def pytest_sessionfinish(session: pytest.Session) -> None:
    # Pools close here, not at exit: an xdist worker reports itself finished after this hook, and
    # the controller SIGKILLs a worker still alive 10 s later. Closing four pools one by one and
    # a framework's interpreter teardown (6-12 s with megatron-core imported, on a loaded 2-core
    # runner) took longer: the killed workers left their pools' folders in /tmp.
    manager = session.config.stash.get(POOL_KEY, None)
    if manager is not None:
        manager.close()
    runner = sys.modules.get("sp_harness.launch.runner")  # never imported here: it imports torch
    if runner is not None:
        runner.close_default_manager()
