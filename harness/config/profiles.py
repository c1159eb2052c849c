"""Stage: config. For property tests: the hypothesis profiles, registered in one place.

- `sp-harness-dev`: a handful of examples per property: this project's fast test tier (its
  default `pytest -n auto`, CI included) and a user's edit-run loop;
- `sp-harness-ci`: 12 per property: this project's full tier (`pytest --tier full`);
- `sp-harness-nightly`: thousands of examples across the properties (the false-alarm measurement);
- `sp-harness-replay`: the example database's failures only.

Registering them changes nothing (names of our own, so a project's `dev` or `ci` stays its
own); `load_default()` makes one the default, and only this project's own tests call it
(tests/conftest.py). Select with `pytest --hypothesis-profile sp-harness-nightly` or
SP_HARNESS_PROFILE=nightly. The example database lives in SP_HARNESS_HYPOTHESIS_DB (default
`.hypothesis/examples` in the working directory): keep that directory in a CI cache so a failure
found once is replayed first on the next run.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PREFIX = "sp-harness-"
NAMES = ("dev", "ci", "nightly", "replay")

_DB = DirectoryBasedExampleDatabase(os.environ.get("SP_HARNESS_HYPOTHESIS_DB", ".hypothesis/examples"))
# every example runs real ranks: wall time is the pool's, not hypothesis' business
_COMMON: dict[str, Any] = dict(deadline=None, database=_DB, print_blob=True,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                      HealthCheck.data_too_large])

settings.register_profile(PREFIX + "dev", max_examples=5, **_COMMON)
settings.register_profile(PREFIX + "ci", max_examples=12, **_COMMON)
settings.register_profile(PREFIX + "nightly", max_examples=400, **_COMMON)
settings.register_profile(PREFIX + "replay", max_examples=1, phases=[Phase.explicit, Phase.reuse], **_COMMON)


TIER_PROFILES = {"fast": "dev", "full": "ci"}
"""This project's test tiers (tests/conftest.py) -> their profile. The fast tier takes `dev` under
CI=true too: what CI runs is what a contributor runs, and its time is the one measured."""


def default_name(tier: str = "fast") -> str:
    """SP_HARNESS_PROFILE (dev, ci, nightly, replay; with or without the prefix), else the test
    tier's (`TIER_PROFILES`); ValueError naming the valid ones."""
    name = os.environ.get("SP_HARNESS_PROFILE") or TIER_PROFILES[tier]
    short = name.removeprefix(PREFIX)
    if short not in NAMES:
        raise ValueError(f"SP_HARNESS_PROFILE={name!r}: valid are {', '.join(NAMES)}")
    return PREFIX + short


def load_default(tier: str = "fast") -> str:
    """Makes `default_name(tier)` hypothesis' default profile; returns its name."""
    name = default_name(tier)
    settings.load_profile(name)
    return name
