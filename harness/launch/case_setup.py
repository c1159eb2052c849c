"""Stage: launch. A case's per-process setup (`Case.setup`), once per process, and the budget it
runs under. Ranks (sp_harness.launch.worker) and their companions (sp_harness.launch.companion)
both run it; it lives below both so neither imports the other back."""

from __future__ import annotations

SETUP_TIMEOUT_S = 600.0
"""Seconds a case's setup may take (its own budget, outside any job's timeout): a framework's
first import or JIT build on a loaded machine takes minutes."""

_SET_UP: set[str] = set()


def setup_once(case_name: str) -> bool:
    """Run `case_name`'s setup in this process unless it ran here before; True when it ran now."""
    if case_name in _SET_UP:
        return False
    # imported here, not at the top: the launch stage needs the case API only when a case is set up
    from sp_harness.config.registry import get_case

    setup = get_case(case_name).setup
    _SET_UP.add(case_name)
    if setup is None:
        return False
    try:
        setup()
    except BaseException:
        _SET_UP.discard(case_name)
        raise
    return True
