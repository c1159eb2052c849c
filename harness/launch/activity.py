"""Stage: launch. Whether a rank is doing anything, read from outside it (Linux's /proc).

The driver samples a rank's stack only when the rank has stopped: faulthandler dumps a stack
from inside a signal handler by reading frames that a running thread may be changing, and on
Python 3.11 that crashed correct ranks. A DTensor rank of `mutant-dtensor-norm-missing-sp` was
killed by SIGSEGV in CI while its job ran; sent every 20 ms to 2 such ranks, the stack signal
killed one 4 times in about 6,000 signals, and a dump taken holding the GIL from a thread of the
rank's own (faulthandler.dump_traceback) 5 times in about 18,000. A rank whose every thread, and
every thread of every process it started (its reference process, a compiler), sleeps without
using the CPU is changing no frames, so a stack taken then is safe. A rank that spins while it
waits (a CUDA synchronize under nccl, a busy-polling transport) counts as running: a desync that
only the stall rule can see (sp_harness.launch.desync) then ends at the job's timeout instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class Activity:
    """One look at a process group's threads."""

    running: bool
    """Some thread is running, runnable or in uninterruptible I/O (state R or D, not S)."""
    cpu_ticks: int
    """User plus system CPU time of all its threads so far, in clock ticks."""


def activity(pgids: Iterable[int], proc: str = "/proc") -> dict[int, Activity] | None:
    """The threads of each process group in `pgids` (a rank started in its own session, and what
    it started) now, from one pass over `proc`; None where it cannot be read (not Linux)."""
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return None
    running = dict.fromkeys(pgids, False)
    ticks = dict.fromkeys(running, 0)
    for pid in pids:
        fields = _stat(f"{proc}/{pid}/stat")
        if fields is None or int(fields[2]) not in running:  # fields after the command: state, ppid, pgrp, ...
            continue
        pgid = int(fields[2])
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue  # it ended since the listing
        for tid in tids:
            task = _stat(f"{proc}/{pid}/task/{tid}/stat")
            if task is None:
                continue
            running[pgid] = running[pgid] or task[0] in ("R", "D")
            ticks[pgid] += int(task[11]) + int(task[12])  # utime, stime
    return {g: Activity(running=running[g], cpu_ticks=ticks[g]) for g in running}


def stopped(pgids: Iterable[int], *, interval_s: float = 0.25, proc: str = "/proc") -> bool:
    """Whether every process group in `pgids` is asleep at two looks `interval_s` apart and used no
    CPU between them (less than one clock tick). True where /proc cannot be read: the caller then
    has no way to tell, and takes the stacks regardless."""
    groups = list(pgids)
    first = activity(groups, proc)
    if first is None:
        return True
    if any(a.running for a in first.values()):
        return False
    time.sleep(interval_s)
    second = activity(groups, proc)
    return second is None or all(not second[g].running and second[g].cpu_ticks == first[g].cpu_ticks
                                 for g in groups)


def _stat(path: str) -> list[str] | None:
    """The fields of a /proc stat file after the command name (which may hold spaces)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()
