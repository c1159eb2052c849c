"""sp-harness: prove a sequence-parallel model agrees with its single-device reference.

The flow, bottom to top, is `sp_harness.stages.STAGES`: each stage is a folder of `harness/`.
The public API for users' own cases is re-exported here.

The names load on first use (PEP 562): importing any `sp_harness` module imports this package
first, and the pytest plugin, which pytest loads in every run of every project where
sp-harness is installed, must not pay for torch's import (about 2 s) there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sp_harness.config.case import Batch, Case, Example, Layout, ParamSpec, Sharded, Training, Unsupported
    from sp_harness.config.check_config import CheckConfig
    from sp_harness.config.rank_context import RankContext
    from sp_harness.config.registry import mutant, register

_EXPORTS = {
    **dict.fromkeys(("Batch", "Case", "Example", "Layout", "ParamSpec", "Sharded", "Training", "Unsupported"),
                    "sp_harness.config.case"),
    "CheckConfig": "sp_harness.config.check_config",
    "RankContext": "sp_harness.config.rank_context",
    "mutant": "sp_harness.config.registry",
    "register": "sp_harness.config.registry",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sp_harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


def check(config: CheckConfig, runner=None):
    """Run one side-by-side check; returns a CheckResult (verdict PASS / FAIL / UNSUPPORTED / ERROR)."""
    from sp_harness.checks.side_by_side import check as _check

    return _check(config, runner)


__all__ = ["Batch", "Case", "CheckConfig", "Example", "Layout", "ParamSpec", "RankContext", "Sharded", "Training",
           "Unsupported", "check", "mutant", "register"]
