"""Stage: config. A job's default timeout: the session's (the pytest plugin's resolved
`sp_timeout`), else SP_HARNESS_TIMEOUT, else `DEFAULT_TIMEOUT_S`. Free of torch: the pytest
plugin sets the session's at configure time, in every pytest run where sp-harness is installed."""

from __future__ import annotations

import math

DEFAULT_TIMEOUT_S = 3600.0
"""The hard cap on a job nobody gave a timeout: a backstop, not how a hang is found. The pool ends
a hung job's wait within seconds (no progress) or at the cap its first step sets
(sp_harness.launch.activity.Liveness); this bounds only a job that computes forever before its
first step or never reports one. A flat 30 s once timed out a correct megatron-gpt-sp at hidden
512, seq 1024 (41 s); bench's realistic rows take up to 384 s on 2 cores and use this hour too."""
_session_timeout_s: float | None = None


def set_session_timeout(seconds: float | None) -> None:
    """This process's job timeout, above the environment's (the pytest plugin sets its resolved
    `sp_timeout` here, so every check a test runs gets it, and no environment variable leaks into
    code that never asked for sp-harness); None clears it."""
    global _session_timeout_s
    _session_timeout_s = seconds


def default_timeout_s() -> float:
    """Seconds a job may run: the session's (`set_session_timeout`), else SP_HARNESS_TIMEOUT
    where set, else DEFAULT_TIMEOUT_S."""
    import os

    if _session_timeout_s is not None:
        return _session_timeout_s
    text = os.environ.get("SP_HARNESS_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"SP_HARNESS_TIMEOUT must be a finite number of seconds > 0, got {text!r}")
    return value
