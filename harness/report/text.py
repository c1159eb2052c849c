"""Stage: report. What `sp-harness check` prints and writes: each check's outcome as text, and one
versioned JSON document for machines."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from sp_harness.checks import Outcome, get_check
from sp_harness.judge.verdict import CheckResult
from sp_harness.report.result_text import format_comm, format_result

SCHEMA_VERSION = 2
"""Of the `--json` document: bumped whenever a field changes meaning or goes away. 2: a crash
before the code under test's first step is status 'error' (verdict ERROR), no longer 'fail';
'skipped' marks an asked-for check not run."""


def format_outcomes(outcomes: Sequence[Outcome], *, verbose: bool = False) -> str:
    parts = []
    for o in outcomes:
        if isinstance(o.figures, CheckResult):
            parts.append(format_result(o.figures, verbose=verbose))
            if o.figures.comm or o.figures.verdict == "PASS":
                parts.append(format_comm(o.figures.comm))
        elif o.skipped:
            parts.append(f"{o.check}: skipped: {o.detail}")
        elif o.status == "n/a" and o.figures is None:
            parts.append(f"{o.check}: not applicable: {o.detail}")
        else:
            parts.append(get_check(o.check).render(o))
    return "\n".join(parts)


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if hasattr(x, "to_json"):
            return _plain(x.to_json())
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def outcomes_json(outcomes: Sequence[Outcome]) -> dict:
    return {"schema_version": SCHEMA_VERSION,
            "outcomes": [dict(check=o.check, status=o.status, skipped=o.skipped, caught_by=o.caught_by, detail=o.detail,
                              repro=o.repro, figures=_plain(o.figures)) for o in outcomes]}


def check_writable(path: str, what: str = "--json") -> None:
    """A usage error (exit 2) before any work if `path` cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{what} {path!r} cannot be written (need a file path in an existing, writable folder)")


def check_output_dir(path: str, what: str = "--out") -> None:
    """A usage error (exit 2) before any work if the folder `path` cannot be made or written into."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what} {path!r} cannot be written ({exc.strerror})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"{what} {path!r} cannot be written (not a writable folder)")


def dump_json(outcomes: Sequence[Outcome], path: str) -> None:
    with open(path, "w") as f:
        json.dump(outcomes_json(outcomes), f, indent=1, default=str)
