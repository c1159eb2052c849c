"""Stage: step. yunchang's releases: the range this integration supports and what differs
inside it, asked as capabilities (sp_harness.cases.frameworks.releases).

Everything else in the package asks this module, never a version string. Importing it imports no
framework code; `missing()` does (the driver asks it in a child interpreter).
"""

from __future__ import annotations

from sp_harness.cases.frameworks.releases import ReleaseRange

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="yunchang", oldest="0.6.4", newest="0.6.4"),
)
"""Supported releases, both ends included: each end's framework tests and release cases pass
(docs/frameworks/README.md, the release matrix)."""


def missing() -> tuple[str, ...]:
    """Each API this integration needs that the installed release lacks, named as a user would
    look it up."""
    return ()
