"""Stage: step. The optional DeepSpeed APIs the installed release lacks, as the release probe asks
them (sp_harness.cases.frameworks.releases.probe runs a module's `missing()` in a child
interpreter): `compat.lacking()`, which only some configs need (`compat.lacks`), where
`compat.missing()` is what every case needs."""

from __future__ import annotations

from sp_harness.cases.frameworks.deepspeed.compat import lacking as missing

__all__ = ["missing"]
