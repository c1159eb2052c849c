"""Stage: launch. Driver side: desync detection from the collectives ranks announce.

c10d pairs collectives up per process group, in issue order. So for every group the driver keeps
each member's announced sequence (sp_harness.launch.announce) and calls it a desync when:

- two members announced a different n-th collective on the group (kind, or payload bytes): found
  the moment the second announcement arrives;
- a member finished the job having announced fewer collectives on the group than another member:
  the extra ones can never pair up;
- every rank still running has been silent for `stall_s` and is waiting inside a collective (its
  stack, which the pool samples once every such rank has stopped using the CPU:
  sp_harness.launch.activity), while the members of some group announced different counts,
  and the same is seen again at the next look, `stall_s` later, with no word from any rank in
  between and every rank's stack unchanged: nobody can move, and the counts say who is where.
  (One look was not enough: on a machine loaded to 20 runnable processes per core a rank's
  announcement arrived after a look that found both ranks waiting in a legitimate collective,
  and a correct seed-mlp run was called a desync.)

Only collectives the accounting sees are announced (sp_harness.capture.comm around the system
under test); the engine's own bookkeeping collectives are not, so a desync against one of those
is found by the third rule alone. Under torchrun there is no driver and nothing is detected:
there a desync ends as the backend's own timeout or error, as in production.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sp_harness.launch.failure import RankError
from sp_harness.launch.wire import Collective

_SIZE_MAY_DIFFER = frozenset({"all_to_all"})
"""Kinds whose payload differs across ranks in correct code (uneven all-to-all splits)."""


def _differs(a: Collective, b: Collective) -> bool:
    return a.kind != b.kind or (a.nbytes != b.nbytes and a.kind not in _SIZE_MAY_DIFFER)


class DesyncWatch:
    """One job's announced collectives, per group and rank, and whether they have desynced."""

    def __init__(self, *, stall_s: float = 2.0):
        self.stall_s = stall_s
        self.sequences: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
        self.finished: set[int] = set()
        self.last_heard: dict[int, float] = {}
        self.found: list[RankError] = []
        """The desync, one error per rank involved (the rank ahead first); empty: none yet."""
        self._probed_at = float("-inf")
        self._suspect: tuple | None = None
        """The counts the last look found everyone blocked at; a second look must confirm them."""

    def heard(self, rank: int, now: float) -> None:
        self.last_heard[rank] = now
        self._suspect = None

    def collective(self, rank: int, c: Collective) -> None:
        if not c.group or self.found:
            return  # an unresolved group cannot be compared
        members = self.sequences.setdefault(c.group, {})
        mine = members.setdefault(rank, [])
        mine.append(c)
        n = len(mine) - 1
        for other, theirs in members.items():
            if other != rank and len(theirs) > n and _differs(theirs[n], c):
                self.found = [_error(other, theirs[n]), _error(rank, c)]
                return
        if self.finished:
            self._behind(self.finished)

    def last(self, rank: int) -> Collective | None:
        """The last collective `rank` announced in this job, on any group; None if none."""
        mine = [c for members in self.sequences.values() for c in members.get(rank, ())]
        return max(mine, key=lambda c: c.index, default=None)

    def done(self, rank: int) -> None:
        """`rank` answered the job: it will announce nothing more."""
        self.finished.add(rank)
        if not self.found:
            self._behind(self.finished)

    def should_probe(self, pending: set[int], now: float) -> bool:
        """Every pending rank silent for `stall_s` (and `stall_s` since the last look), while the
        counts of some group differ: time to look at the pending ranks' stacks. A rank found
        computing may block later without a word, so the look repeats while the stall lasts."""
        if self.found or not pending:
            return False
        quiet_since = max(self.last_heard.get(r, float("-inf")) for r in pending)
        if now - max(quiet_since, self._probed_at) < self.stall_s or self._uneven_group() is None:
            return False
        self._probed_at = now
        return True

    def probed(self, pending: set[int], waiting: set[int], frames: Mapping[int, Sequence[str]] | None = None) -> None:
        """The stacks say `waiting` are inside a collective; if that is every pending rank at two
        looks in a row with nothing heard between them, and no rank's stack (`frames`: each
        pending rank's frame lines at this look) moved between them, nothing can move and a
        group whose counts differ is a desync. A rank whose stack changed is working inside
        c10d's Python (pickling an object collective's payload, checking arguments) and may
        still announce: under load (4 ranks of 2 threads each on 2 cores, beside their
        references' processes) a correct ulysses-gpt run was called a desync after two looks."""
        if not waiting >= pending:
            self._suspect = None
            return
        stacks = tuple(sorted((r, tuple(f)) for r, f in frames.items())) if frames is not None else ()
        counts = (frozenset(pending), self._counts(), stacks)
        if self._suspect == counts:
            self._behind(self.finished | pending)
        self._suspect = counts

    def _counts(self) -> tuple:
        return tuple(sorted((g, r, len(seq)) for g, members in self.sequences.items() for r, seq in members.items()))

    def _uneven_group(self) -> tuple[int, ...] | None:
        for group, members in self.sequences.items():
            if len({len(members.get(r, ())) for r in group}) > 1:
                return group
        return None

    def _behind(self, settled: set[int]) -> None:
        """A desync where a settled rank (it announces nothing more) announced fewer collectives
        on a group than another member did."""
        for group, members in self.sequences.items():
            for behind in sorted(settled & set(group)):
                n = len(members.get(behind, ()))
                ahead = next((r for r in group if len(members.get(r, ())) > n), None)
                if ahead is not None:
                    ranks = ",".join(map(str, group))
                    where = "finished the job" if behind in self.finished else "blocked in an unannounced collective"
                    self.found = [_error(ahead, members[ahead][n]),
                                  RankError(rank=behind, kind="desync",
                                            detail=f"{where} after {n} collective(s) on ranks {ranks}; "
                                                   f"it issued no collective #{n} there")]
                    return


def _error(rank: int, c: Collective) -> RankError:
    return RankError(rank=rank, kind="desync", collective=c)
