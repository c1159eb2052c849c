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
only the stall rule can see (sp_harness.launch.desync) then ends at the job's cap or timeout instead.

The same looks decide when a job is hung (`Liveness`): not when it is slow, but when no pending
rank has made progress (no message, next to no CPU, asleep at most looks) for `NO_PROGRESS_S`;
a rank that computes, however long, is not hung. What computes forever (a spinning wait, a
loop that never ends) ends at a cap set by the job's own first step (`CAP_FACTOR`, `CAP_FLOOR_S`),
or at the job's timeout, a hard cap, whichever comes first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal


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


NO_PROGRESS_S = 10.0
"""Seconds every pending rank must have been idle (`Liveness.look`) before the job counts as
hung. A correct job is never idle this long: each rank computes (CPU), waits in a collective
for a peer that computes, or tells the driver something. It is five of the desync stall's looks
(sp_harness.launch.replies._STALL_S), so a desync the stall rule can name is still named as one;
longer would only delay the report of a real hang."""

IDLE_SHARE = 0.02
"""The CPU an idle rank may use over that window, as a share of one core. Hung in a collective,
a gloo rank and its reference process used 3 ticks in 11 s (0.3%: background threads; on an
idle 2-core machine), and the desync probe's stack dumps a few ms each; a correct rank starved
among 20 runnable processes per core still gets 5%, and is seen runnable at most looks."""

LOOK_S = 1.0
"""How often the driver reads /proc while every pending rank is silent: one pass over /proc
costs about 8 ms with 94 processes on the machine."""

CAP_FACTOR = 10.0
"""A job's cap, in its steps at its first step's pace: the first step, set-up included (models
built, first-call costs paid), is a check's slowest, so a correct job ends well inside 10 x its
steps even if the machine's load rises severalfold after that step."""

CAP_FLOOR_S = 120.0
"""The least cap: a toy job's first step takes milliseconds, while what follows its steps (the
verdict, localizing a failure) and a load spike do not scale with it. The suite's own job
timeout (the pytest plugin's sp_timeout) is the same 120 s."""

try:
    _TICKS_PER_S = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):  # no sysconf: no /proc either, and no look is taken
    _TICKS_PER_S = 100

Rule = Literal["", "no progress", "cap"]


class Liveness:
    """One job's evidence that its pending ranks are moving, and the cap its first step sets; fed
    by the wait for the job's replies (sp_harness.launch.replies), which stops when `stop` says."""

    def __init__(self, *, start: float, timeout_s: float, proc: str = "/proc"):
        self.start = start
        self.timeout_s = timeout_s
        """The job's hard cap: the derived cap applies only below it."""
        self.proc = proc
        self.last_heard = start
        self.looks: list[tuple[float, dict[int, Activity]]] = []
        """(when, rank -> its activity) since the last message, oldest first."""
        self.first_step_s: float | None = None
        """Seconds per step up to the first report of steps done, from the job's start."""
        self.steps = 0
        """The steps the job said it runs."""
        self.fired: Rule = ""
        """Which rule ended the wait; '' while none has."""
        self.fired_at = 0.0
        """When it fired (time.monotonic())."""
        self.quiet_s = 0.0
        """For 'no progress': seconds from the last message to the look that fired."""

    def heard(self, now: float) -> None:
        """A message came from a pending rank: it is moving, and the idle window starts over."""
        self.last_heard = now
        self.looks.clear()

    def progress(self, now: float, done: int, total: int) -> None:
        """A rank reported `done` of `total` steps; the first report sets the cap."""
        self.heard(now)
        if self.first_step_s is None and done >= 1:
            self.first_step_s, self.steps = (now - self.start) / done, total

    @property
    def cap_s(self) -> float | None:
        """The cap the first step set; None before any step was reported."""
        if self.first_step_s is None:
            return None
        return max(CAP_FLOOR_S, CAP_FACTOR * self.first_step_s * max(self.steps, 1))

    def cap_text(self) -> str:
        """How the cap was set, for the message of a job that ran past it."""
        assert self.first_step_s is not None and self.cap_s is not None, "no step set a cap"
        pace = f"{CAP_FACTOR:g} x its {self.steps} step(s) at its first step's {self.first_step_s:.1f} s"
        if self.cap_s == CAP_FLOOR_S:
            return f"ran past its cap of {self.cap_s:.0f} s (the floor: {pace} is less)"
        return f"ran past its cap of {self.cap_s:.0f} s ({pace}, set-up included)"

    def stop(self, now: float, pgids: Mapping[int, int]) -> bool:
        """Whether to stop waiting for the pending ranks (rank -> its process group) now: past the
        cap, or idle for `NO_PROGRESS_S` (a look at /proc every `LOOK_S` while they are silent).
        `fired` says which."""
        cap = self.cap_s
        if cap is not None and cap < self.timeout_s and now - self.start >= cap:
            self.fired, self.fired_at = "cap", now
            return True
        if now - self.last_heard < LOOK_S or (self.looks and now - self.looks[-1][0] < LOOK_S):
            return False
        seen = activity(pgids.values(), self.proc)
        return self.look(now, None if seen is None else {rank: seen[g] for rank, g in pgids.items()})

    def look(self, now: float, seen: Mapping[int, Activity] | None) -> bool:
        """Takes one look at the pending ranks (rank -> its activity; None where /proc cannot be
        read, which is no evidence of idleness); True when every one of them has been idle since
        a look at least `NO_PROGRESS_S` old: it used at most `IDLE_SHARE` of a core since, and
        was runnable at fewer than half the looks (an idle rank's background thread is caught
        running now and then)."""
        if seen is None:
            return False
        self.looks.append((now, dict(seen)))
        old = [i for i, (t, _) in enumerate(self.looks) if t <= now - NO_PROGRESS_S]
        if not old:
            return False
        del self.looks[:old[-1]]
        (since, first), later = self.looks[0], self.looks[1:]
        budget = IDLE_SHARE * (now - since) * _TICKS_PER_S
        for rank, now_seen in seen.items():
            then = first.get(rank)
            if then is None or now_seen.cpu_ticks - then.cpu_ticks > budget:
                return False
            if 2 * sum(look[rank].running for _, look in later) >= len(later):
                return False
        self.fired, self.fired_at, self.quiet_s = "no progress", now, now - self.last_heard
        return True


def _stat(path: str) -> list[str] | None:
    """The fields of a /proc stat file after the command name (which may hold spaces)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()
