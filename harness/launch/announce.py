"""Stage: launch. Rank side: what a rank tells the driver while a job runs: each collective
it is about to issue (for desync detection, sp_harness.launch.desync) and how far the job is.

The worker opens a channel for each job on the job's own pipe; outside a pool job (torchrun, a
plain process) there is no channel and both calls return at once. A message is sent per
collective, before it is issued: a rank that then blocks in it has already said where. Sending
is one small pickle on a local socket the driver drains while it waits (measured overhead in
the commit that added this: well under 1% of a check's wall time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sp_harness.launch.wire import Collective, CollectiveIssued, PhaseEntered, Progress


class _Channel:
    """One job's announcements: the pipe, and the rank's running collective counts."""

    def __init__(self, conn: Any, job_id: int):
        self.conn = conn
        self.job_id = job_id
        self.count = 0
        self.per_group: dict[tuple[int, ...], int] = {}
        # autograd may run a backward collective on a device thread: one sender at a time
        self.lock = threading.Lock()


_CHANNEL: _Channel | None = None
_PHASE = ""
"""The current job's phase ('' until the job marks one: `phase`)."""
_MODULE: Callable[[], str] | None = None
"""Where the rank is in its sharded model ('' for nowhere), while a side-by-side pass tracks it."""

_POINT_TO_POINT = frozenset({"send", "recv"})
"""Not announced: a send pairs with a recv on one peer, not with the group's n-th collective, so
counting them per group would misalign the group's sequence on the ranks not involved."""


def open_job(conn: Any, job_id: int) -> None:
    """Announcements from now on go to `conn`, for job `job_id`, counted from 0."""
    global _CHANNEL, _PHASE
    _CHANNEL = _Channel(conn, job_id)
    _PHASE = ""


def close_job() -> None:
    global _CHANNEL, _PHASE
    _CHANNEL = None
    _PHASE = ""


def phase(name: str) -> None:
    """The job enters phase `name` (sp_harness.launch.wire.STEPS once the code under test steps):
    a raise carries it in the reply, and the driver hears it, for a rank that dies or hangs."""
    global _PHASE
    _PHASE = name
    channel = _CHANNEL
    if channel is None:
        return
    with channel.lock:
        channel.conn.send(PhaseEntered(job_id=channel.job_id, phase=name))


def current_phase() -> str:
    return _PHASE


def reset_phase() -> None:
    """A new job starts in no phase (under torchrun no channel opens per job to reset it)."""
    global _PHASE
    _PHASE = ""


def track_module(where: Callable[[], str] | None) -> None:
    """Each announced collective names `where()`'s module from now on (None: no module)."""
    global _MODULE
    _MODULE = where


def collective(kind: str, nbytes: int, group: tuple[int, ...]) -> None:
    """The rank is about to issue a collective `kind` of `nbytes` on the ranks `group`."""
    channel = _CHANNEL
    if channel is None or kind in _POINT_TO_POINT:
        return
    with channel.lock:
        index = channel.per_group.get(group, 0)
        channel.per_group[group] = index + 1
        module = _MODULE() if _MODULE is not None else ""
        issued = Collective(index=channel.count, group_index=index, kind=kind, nbytes=nbytes, group=group,
                            module=module)
        channel.count += 1
        channel.conn.send(CollectiveIssued(job_id=channel.job_id, collective=issued))


def progress(what: str, done: int, total: int) -> None:
    """The job has done `done` of `total` `what`s (e.g. steps)."""
    channel = _CHANNEL
    if channel is None:
        return
    with channel.lock:
        channel.conn.send(Progress(job_id=channel.job_id, what=what, done=done, total=total))
