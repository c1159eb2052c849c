"""Stage: launch. A case's per-process setup (`Case.setup`), once per process, and the budget it
runs under. Ranks (sp_harness.launch.worker) and their companions (sp_harness.launch.companion)
both run it; it lives below both so neither imports the other back."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

SETUP_TIMEOUT_S = 600.0
"""Seconds a case's setup may take (its own budget, outside any job's timeout): a framework's
first import or JIT build on a loaded machine takes minutes."""

_SET_UP: set[str] = set()


def load_preload(entries: Iterable[str]) -> None:
    """A case's `Case.preload` entries, in order: each module imported, each "module:function"'s
    function called (a no-op where the fork server did it already: the module is imported, the
    shims are idempotent)."""
    for entry in entries:
        module, _, function = entry.partition(":")
        try:
            imported = importlib.import_module(module)
        except Exception as exc:
            # a framework found but broken at import (the registry only finds it, never imports
            # it): its cases cannot run here, which is not a verdict on them
            from sp_harness.config.case import Unsupported
            from sp_harness.config.registry import install_hint

            first = (str(exc).strip().splitlines() or [""])[0]
            raise Unsupported(f"needs {module}, whose import fails here ({type(exc).__name__}: {first}) "
                              f"({install_hint(module)})") from exc
        if function:
            getattr(imported, function)()


def setup_once(case_name: str) -> bool:
    """Run `case_name`'s preload, then its setup, in this process unless they ran here before (a
    GPU pool's or a fresh interpreter's ranks had no fork server import them); True when the
    setup ran now."""
    if case_name in _SET_UP:
        return False
    # imported here, not at the top: the launch stage needs the case API only when a case is set up
    from sp_harness.config.registry import get_case

    case = get_case(case_name)
    _SET_UP.add(case_name)
    try:
        load_preload(case.preload)
        if case.setup is None:
            return False
        case.setup()
    except BaseException:
        _SET_UP.discard(case_name)
        raise
    return True
