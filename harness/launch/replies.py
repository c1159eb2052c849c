"""Stage: launch. Waiting for one job's replies from every rank of a pool: the results, the ranks
that raised or ended, those that did not answer in time, and a desync found meanwhile.

A rank that fails makes the others hang or fail soon after, so after a first error the others get
a short grace period, not the job's timeout. While replies are pending the wait wakes every
`_POLL_S` to look for a stall: a desync (ranks whose collectives cannot pair up) is found from
the collectives the ranks announce (sp_harness.launch.desync) within seconds rather than at the
timeout. A signal's exception that something swallowed on its way up is raised again here
(`interrupt_pending`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_conns
from typing import Any

from sp_harness.launch.activity import Liveness, stopped
from sp_harness.launch.desync import DesyncWatch
from sp_harness.launch.failure import RankError, raised, stack_frames, waiting_in_collective
from sp_harness.launch.rank_probe import RankProbe
from sp_harness.launch.wire import CollectiveIssued, JobDone, JobRaised, PhaseEntered, Progress

# after one rank fails, how long the others get to report before they count as hung
_FAILURE_GRACE_S = 2.0
# how often the wait loop looks for a stall, and how long every pending rank must have been
# silent before their stacks are sampled (a desync where counts differ: sp_harness.launch.desync)
_POLL_S = 0.5
_STALL_S = 2.0


@dataclass(kw_only=True)
class Replies:
    """What came back for the current job so far."""

    pending: dict[int, Any]
    """Rank -> its pipe, for ranks that have not replied."""
    watch: DesyncWatch
    results: dict[int, Any] = field(default_factory=dict)
    errors: list[RankError] = field(default_factory=list)
    """In the order they came."""
    phases: dict[int, str] = field(default_factory=dict)
    """Rank -> the last phase it announced (sp_harness.launch.announce.phase)."""
    live: Liveness | None = None
    """Whether the pending ranks are moving, for a wait that ends when they are not (a job's own;
    None: start-up's and setup's, on their flat budgets)."""

    @property
    def desync(self) -> list[RankError]:
        return self.watch.found


_interrupt: BaseException | None = None


def interrupt_pending(exc: BaseException | None) -> None:
    """A signal handler's exception (KeyboardInterrupt, or the CLI's SIGTERM), kept until cleared
    with None: a handler's exception raised inside a `__del__` or a weakref callback is printed
    and swallowed by Python, and the driver would wait on its ranks forever; the wait loop raises
    it again at its next wake-up (within _POLL_S)."""
    global _interrupt
    _interrupt = exc


def collect(conns: list[Any], probes: list[RankProbe], *, job_id: int, timeout_s: float,
            progress: Callable[[str], None] | None, live: Liveness | None = None) -> Replies:
    """Replies to job `job_id` from the ranks on `conns`, the ranks that did not answer in time (or
    within the grace period after an error), or a desync found in the collectives they announced.
    With `live`, also the ranks pending when it stopped the wait (`live.fired` says why)."""
    got = Replies(pending=dict(enumerate(conns)), watch=DesyncWatch(stall_s=_STALL_S), live=live)
    now = time.monotonic()
    deadline = now + timeout_s
    for rank in range(len(conns)):
        got.watch.heard(rank, now)
    while got.pending and not got.watch.found:
        if _interrupt is not None:
            raise _interrupt  # a signal whose exception something swallowed on its way up
        if got.errors:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        # wake at least every _POLL_S to look for a stall while results are pending
        wait_s = min(_POLL_S, max(0.0, deadline - time.monotonic()))
        for conn in wait_conns(list(got.pending.values()), timeout=wait_s):
            _receive(probes[conns.index(conn)], got, job_id, progress)
        now = time.monotonic()
        pending = set(got.pending)
        if got.watch.should_probe(pending, now):
            # a stack only from ranks that have stopped: a dump can crash a running one
            if stopped(probes[r].proc.pid for r in pending):
                stacks = {r: probes[r].stack_now() for r in pending}
                got.watch.probed(pending, {r for r in pending if waiting_in_collective(stacks[r])},
                                 {r: stack_frames(stack) for r, stack in stacks.items()})
            else:
                got.watch.probed(pending, set())
        if live is not None and pending and not got.watch.found and live.stop(
                now, {r: probes[r].proc.pid for r in pending}):
            break
        if now >= deadline:
            break
    return got


def _receive(probe: RankProbe, got: Replies, job_id: int, progress: Callable[[str], None] | None) -> None:
    """Take one message from `probe`'s rank: an announcement, progress, or its reply to the job."""
    rank = probe.rank
    conn = got.pending[rank]
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        del got.pending[rank]
        ended = dataclasses.replace(probe.ended(), phase=got.phases.get(rank, ""))
        last = got.watch.last(rank)
        got.errors.append(dataclasses.replace(ended, collective=last) if last is not None else ended)
        return
    now = time.monotonic()
    got.watch.heard(rank, now)
    if got.live is not None:
        got.live.heard(now)
    current = getattr(msg, "job_id", None) == job_id
    if isinstance(msg, CollectiveIssued) and current:
        got.watch.collective(rank, msg.collective)
    elif isinstance(msg, PhaseEntered) and current:
        got.phases[rank] = msg.phase
    elif isinstance(msg, Progress) and current:
        if got.live is not None:
            got.live.progress(now, msg.done, msg.total)
        if progress and rank == 0:  # ranks go in lockstep: one line per step is enough
            progress(f"{msg.what} {msg.done}/{msg.total}")
    elif isinstance(msg, JobDone) and current:
        del got.pending[rank]
        got.results[rank] = msg.result
        got.watch.done(rank)
    elif isinstance(msg, JobRaised) and current:
        del got.pending[rank]
        got.errors.append(raised(rank, msg))
    else:
        raise TypeError(f"rank {rank} sent {msg!r}, not a message of job {job_id}")
