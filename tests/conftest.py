"""This project's own test settings (a plugin must not impose them on other projects: the
sp-harness plugin only registers what is here loaded).

Two tiers (docs/benchmarks.md, "The test suite's tiers"):
- `fast`, the default (`python -m pytest -n auto`, what CI runs): every check, case, mutant pin
  and framework integration, each at its smallest config that still exercises it;
- `full` (`--tier full`, `SP_HARNESS_TIER=full`, `tox -e full`): also the tests marked
  `exhaustive` (larger meshes, more kernel families, whole mutant batteries, more hypothesis
  examples). Run it before changing a tolerance, a launcher or a framework integration.
A test left out of the fast tier is deselected, so pytest's summary line counts it.
"""

from __future__ import annotations

import os

import pytest

from sp_harness.config import profiles
from sp_harness.pytest_plugin import option

TIERS = ("fast", "full")
TIER_KEY: pytest.StashKey[str] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=TIERS, default=None,
                     help="fast (default): the CI tier; full: also the tests marked exhaustive (env SP_HARNESS_TIER)")


def tier_of(config: pytest.Config) -> str:
    tier = config.getoption("tier") or os.environ.get("SP_HARNESS_TIER") or "fast"
    if tier not in TIERS:
        raise pytest.UsageError(f"SP_HARNESS_TIER={tier!r}: valid are {', '.join(TIERS)}")
    return tier


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exhaustive(why): runs in the full tier only; `why` names what the fast "
                                       "tier runs instead (the same check, case, mutant or framework, smaller)")
    config.stash[TIER_KEY] = tier = tier_of(config)
    profiles.load_default(tier)
    # the CLI runs some tests start as subprocesses take the suite's job timeout too
    os.environ["SP_HARNESS_TIMEOUT"] = repr(option(config, "sp_timeout"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.stash[TIER_KEY] == "full":
        return
    for item in items:
        marker = item.get_closest_marker("exhaustive")
        assert marker is None or (marker.args and marker.args[0]), f"{item.nodeid}: exhaustive(why) needs its why"
    dropped = [item for item in items if item.get_closest_marker("exhaustive")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]


@pytest.fixture(scope="session")
def tier(request: pytest.FixtureRequest) -> str:
    """The tier this run is (`fast` or `full`)."""
    return request.config.stash[TIER_KEY]
