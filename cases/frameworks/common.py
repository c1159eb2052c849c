"""Stage: step. What the framework integrations share."""

from __future__ import annotations

from sp_harness.config.case import Unsupported
from sp_harness.config.check_config import CheckConfig


def require_tp(cfg: CheckConfig, tp: int | None, name: str, framework: str) -> int:
    """The run's TP degree (world size / dp); Unsupported naming both where a case built for TP
    `tp` (None: any) meets a run at another."""
    run_tp = cfg.world_size // cfg.dp
    if tp is not None and run_tp != tp:
        raise Unsupported(f"{name} is {framework} at TP {tp}; this run has TP {run_tp} "
                          f"(world size {cfg.world_size}, dp {cfg.dp})")
    return run_tp
