"""Stage: checks. Every module in this package that defines `CHECK` contributes one check; which
run where is the caller's choice (the battery's entries, `sp-harness check`'s flags)."""

from __future__ import annotations

import importlib
import pkgutil

from sp_harness.checks.base import Check, Outcome, not_applicable, run_check
from sp_harness.launch.manager import add_rank_preload

_CHECKS: dict[str, Check] | None = None


def all_checks() -> dict[str, Check]:
    """name -> check, discovered from this package."""
    global _CHECKS
    if _CHECKS is None:
        found = {}
        for info in pkgutil.iter_modules(__path__):
            module = importlib.import_module(f"{__name__}.{info.name}")
            check = getattr(module, "CHECK", None)
            if check is not None:
                assert isinstance(check, Check), f"{module.__name__}.CHECK is not a Check"
                assert check.name not in found, f"two checks named {check.name!r}"
                found[check.name] = check
        _CHECKS = found
    return dict(_CHECKS)


def get_check(name: str) -> Check:
    checks = all_checks()
    if name not in checks:
        raise ValueError(f"unknown check {name!r}; checks: {', '.join(sorted(checks))}")
    return checks[name]


__all__ = ["Check", "Outcome", "all_checks", "get_check", "not_applicable", "run_check"]


# the fork servers import every check's modules (their rank sides too) before they fork, instead
# of each rank and reference process importing them (sp_harness.launch.manager.RANK_PRELOAD)
add_rank_preload(f"{__name__}:all_checks")
