"""Stage: launch. A process's warm pools (sp_harness.launch.pool), one per world size and case
isolation, started lazily; the least recently used is closed beyond `max_pools`."""

from __future__ import annotations

import atexit
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from sp_harness.config.case import SHARED_PROCESSES, isolation_key
from sp_harness.config.registry import get_case
from sp_harness.launch import zygote_registry
from sp_harness.launch.pool import RankPool
from sp_harness.launch.wire import PoolOptions
from sp_harness.launch.zygote_server import PRELOAD_ENV

P = TypeVar("P")
R = TypeVar("R")

RANK_PRELOAD: list[str] = []
"""Preload entries (`Case.preload`'s form) every CPU pool's fork server imports whatever its case:
the modules the stages above this one run in every rank, which this stage cannot name, so they
add themselves (`add_rank_preload`; sp_harness.checks adds its checks' modules). Each rank and
reference process imported them itself before: 75 modules, about 0.15 s a process, some 600
processes a test-suite run."""


def add_rank_preload(*entries: str) -> None:
    """Adds `entries` to `RANK_PRELOAD` (once each), for the pools started from now on."""
    RANK_PRELOAD.extend(e for e in entries if e not in RANK_PRELOAD)


class PoolManager:
    """Pools by world size, started lazily, the least recently used closed beyond `max_pools`."""

    def __init__(self, options: PoolOptions = PoolOptions(), *, max_pools: int = 3):
        self.options = options
        self.max_pools = max_pools
        self._pools: OrderedDict[tuple[int, str], RankPool] = OrderedDict()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def get(self, world_size: int, isolation: str = SHARED_PROCESSES, *, preload: tuple[str, ...] = ()) -> RankPool:
        """The pool of `world_size` ranks for cases of isolation key `isolation`
        (sp_harness.config.case.isolation_key): a case that runs in processes of its own gets them.
        `preload`: the first case's `Case.preload`, imported by the fork server its ranks come from
        (where the pool is new; the cases sharing a pool are one framework's, with one preload),
        after `RANK_PRELOAD`."""
        key = (world_size, isolation)
        with self._lock:
            pool = self._pools.pop(key, None)
            if pool is None:
                options = self.options
                preload = (*RANK_PRELOAD, *preload)
                if preload and options.backend == "gloo":  # CPU only: see PRELOAD_ENV
                    options = dataclasses.replace(options, env=(*options.env, (PRELOAD_ENV, ",".join(preload))))
                pool = RankPool(world_size, options)
            self._pools[key] = pool
            while len(self._pools) > self.max_pools:
                _, old = self._pools.popitem(last=False)
                old.close()
            return pool

    def run(self, world_size: int, fn: Callable[[P], R], payload: P, *, timeout_s: float, label: str,
            progress: Callable[[str], None] | None = None, case: str | None = None) -> list[R]:
        """Run `fn(payload)` on `world_size` ranks (see `RankPool.run`). `case`: the case the job runs, which picks the pool (its isolation) and whose setup runs
        first; None for jobs of no case (health checks, probes), on the shared pool."""
        if case is None:
            return self.get(world_size).run(fn, payload, timeout_s=timeout_s, label=label, progress=progress)
        spec = get_case(case)
        return self.get(world_size, isolation_key(spec), preload=spec.preload).run(
            fn, payload, timeout_s=timeout_s, label=label, progress=progress,
            setup=case if spec.setup is not None or spec.preload else None)

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.request_shutdown()
        for pool in pools:
            pool.close()
        # the fork servers no pool uses any more, and their temp dirs (sp_harness.launch.zygote_registry)
        zygote_registry.close_idle()
