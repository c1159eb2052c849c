"""This project's own test settings (a plugin must not impose them on other projects: the
sp-harness plugin only registers what is here loaded)."""

import os

import pytest

from sp_harness.config import profiles
from sp_harness.pytest_plugin import option


def pytest_configure(config: pytest.Config) -> None:
    profiles.load_default()
    # the CLI runs some tests start as subprocesses take the suite's job timeout too
    os.environ["SP_HARNESS_TIMEOUT"] = repr(option(config, "sp_timeout"))
