"""Stage: config (for property tests). The hypothesis profiles, registered in one place.

- `dev`: a handful of examples per property, for the edit-run loop;
- `ci`: the default under CI=true, sized so `pytest -n auto` stays within minutes on 2 cores;
- `nightly`: thousands of examples across the properties (the false-alarm measurement).
Select with `pytest --hypothesis-profile NAME` or SP_HARNESS_PROFILE=NAME. The example database
lives in SP_HARNESS_HYPOTHESIS_DB (default `.hypothesis/examples` in the working directory): keep
that directory in a CI cache so a failure found once is replayed first on the next run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_DB = DirectoryBasedExampleDatabase(os.environ.get("SP_HARNESS_HYPOTHESIS_DB", ".hypothesis/examples"))
# every example runs real ranks: wall time is the pool's, not hypothesis' business
_COMMON = dict(deadline=None, database=_DB, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large])

settings.register_profile("dev", max_examples=5, **_COMMON)
settings.register_profile("ci", max_examples=12, **_COMMON)
settings.register_profile("nightly", max_examples=400, **_COMMON)
settings.register_profile("replay", max_examples=1, phases=[Phase.explicit, Phase.reuse], **_COMMON)

_default = os.environ.get("SP_HARNESS_PROFILE") or ("ci" if os.environ.get("CI", "").lower() in ("1", "true") else "dev")
settings.load_profile(_default)
