"""Stage: config. What the machine has, checked before any rank starts: a config that cannot fit
is the user's input being wrong (exit 2), never a run that ends in a FAIL or the OOM killer."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def machine_memory_bytes() -> int:
    """Physical memory, or the cgroup's limit where that is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.3g} GiB"


def require_memory(floor_bytes: int, what: str) -> None:
    """ValueError naming both figures where `floor_bytes` (a lower bound of one process's peak)
    exceeds the machine's memory."""
    have = machine_memory_bytes()
    if floor_bytes > have:
        raise ValueError(f"{what}: needs at least {gib(floor_bytes)} in one reference process (estimated), "
                         f"this machine has {gib(have)}: lower --hidden, --seq-len, --batch or --num-layers")
