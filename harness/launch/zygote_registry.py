"""Stage: launch. Which zygote (sp_harness.launch.zygote) a pool's ranks are forked from: one per
rank environment in this driver, started at the first pool that needs it, closed when idle.

Zygotes are keyed by the environment they start under: the driver's, plus the pool's
`PoolOptions.env`, less the per-pool TMPDIR and SP_HARNESS_AUTHKEY (and PYTEST_CURRENT_TEST,
which pytest changes at every test phase). torch reads some of it at import or first use
(ATEN_CPU_CAPABILITY, OMP_NUM_THREADS), so a pool with another environment gets a zygote of its
own. A zygote is closed, with its temp dir, at `PoolManager.close` when no rank uses it
(`close_idle`), else at exit (`close_all`).

SP_HARNESS_FORKSERVER=0, or a platform other than Linux, starts every rank as a fresh interpreter
(`subprocess.Popen`); so does a pool whose zygote failed to start (with a warning).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
from collections import OrderedDict

from sp_harness.launch.zygote import Zygote, ZygoteError

ENV_VAR = "SP_HARNESS_FORKSERVER"
# values each pool sets for itself (or pytest per test phase): never part of a zygote's key
PER_POOL = frozenset({"TMPDIR", "SP_HARNESS_AUTHKEY", "PYTEST_CURRENT_TEST"})
# zygotes no rank uses, kept beside the one in use (each holds torch's import: ~300 MB resident)
_MAX_IDLE = 2


def enabled() -> bool:
    """Whether pools fork their ranks from a zygote (Linux, unless SP_HARNESS_FORKSERVER=0)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and os.environ.get(ENV_VAR, "1") != "0"


_REGISTRY: OrderedDict[tuple[tuple[str, str], ...], Zygote] = OrderedDict()
_FAILED: dict[tuple[tuple[str, str], ...], str] = {}
_REGISTRY_LOCK = threading.Lock()


def for_env(env: dict[str, str], timeout_s: float) -> Zygote | None:
    """The zygote for ranks of environment `env` (started now if need be); None where it cannot
    start, with a warning: the pool then starts its ranks as subprocesses."""
    base = {k: v for k, v in env.items() if k not in PER_POOL}
    key = (("", sys.executable),) + tuple(sorted(base.items()))
    with _REGISTRY_LOCK:
        if key in _FAILED:
            return None
        zygote = _REGISTRY.pop(key, None)
        if zygote is not None and not zygote.alive:
            zygote.close()
            zygote = None
        if zygote is None:
            try:
                zygote = Zygote(base)
            except OSError as exc:
                _failed(key, f"{type(exc).__name__}: {exc}")
                return None
            try:
                zygote.wait_ready(timeout_s)
            except ZygoteError as exc:
                zygote.close()
                _failed(key, str(exc))
                return None
            except BaseException:  # Ctrl-C while it imports
                zygote.close()
                raise
        _REGISTRY[key] = zygote  # most recently used last
        idle = [k for k, z in _REGISTRY.items() if k != key and z.idle]
        for k in idle[:max(0, len(idle) - _MAX_IDLE)]:
            _REGISTRY.pop(k).close()
        return zygote


def _failed(key: tuple[tuple[str, str], ...], why: str) -> None:
    _FAILED[key] = why
    warnings.warn(f"sp-harness: the rank fork server did not start, so ranks start as fresh interpreters "
                  f"(seconds slower; {ENV_VAR}=0 says so without trying): {why}", RuntimeWarning, stacklevel=3)


def close_idle() -> None:
    """Closes the zygotes no rank process uses (PoolManager.close: a pytest-xdist worker closes its
    pools before it reports itself finished, and may be SIGKILLed soon after)."""
    with _REGISTRY_LOCK:
        for key in [k for k, z in _REGISTRY.items() if z.idle]:
            _REGISTRY.pop(key).close()


def close_all() -> None:
    """Closes every zygote of this process (at exit), and the ranks they forked."""
    with _REGISTRY_LOCK:
        zygotes = list(_REGISTRY.values())
        _REGISTRY.clear()
    for zygote in zygotes:
        zygote.close()


def _forget_after_fork() -> None:
    # a forked copy of the driver shares the parent's pipes: the zygotes are the parent's to use
    _REGISTRY.clear()
    _FAILED.clear()


# registered at import, before any PoolManager's: runs after their close (atexit runs in reverse)
atexit.register(close_all)
os.register_at_fork(after_in_child=_forget_after_fork)
