"""Stage: launch. What the driver can learn about one rank process from outside it: its Python stack
now, its fatal-signal stack, its log's tail, and the `RankError` for a rank that ended or hung.

A rank writes into its pool's scratch folder: `rank<N>.log` (its stdout and stderr: a C++ abort
such as gloo's size-mismatch enforce is only ever printed there), `rank<N>.stack.txt` (faulthandler
dumps on SIGUSR1) and `rank<N>.fatal.txt` (faulthandler on a fatal signal). The driver reads them
for a failure's report; it asks a live rank for its stack only once the rank has stopped
(sp_harness.launch.activity), since a dump can crash a running one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

from sp_harness.launch.failure import RankError, process_ended
from sp_harness.launch.zygote import RankProcess


def rank_path(folder: str, rank: int, suffix: str) -> str:
    """Where rank `rank` of the pool whose scratch folder is `folder` writes its `suffix` file."""
    return os.path.join(folder, f"rank{rank}.{suffix}")


def _read(path: str, offset: int = 0) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True, kw_only=True)
class RankProbe:
    """One rank process of a running pool, and the files it writes in the pool's `folder`."""

    rank: int
    proc: subprocess.Popen | RankProcess
    folder: str

    def log_tail(self, num_lines: int = 12) -> str:
        rows = [r for r in _read(rank_path(self.folder, self.rank, "log")).splitlines() if r.strip()]
        return "\n".join(rows[-num_lines:])

    def ended(self, *, detail: str = "") -> RankError:
        """The error for a rank whose process ended (its pipe closed) without a reply."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return process_ended(self.rank, self.proc.poll(), stack=_read(rank_path(self.folder, self.rank, "fatal.txt")),
                             log_tail=self.log_tail(), detail=detail)

    def hung(self) -> RankError:
        """The error for a rank that did not answer in time: its stack now, or how it ended."""
        if self.proc.poll() is not None:
            return self.ended()
        stack = self.stack_now()
        return RankError(rank=self.rank, kind="timeout", traceback=stack,
                         detail="" if stack else "hung (no stack available)")

    def stack_now(self) -> str:
        """The rank's Python stack now (faulthandler on SIGUSR1), or its fatal-signal stack if it
        died; '' if neither. A rank may be asked more than once (a stall, then a timeout): its
        dumps append to one file, so only what this dump wrote is read."""
        if self.proc.poll() is not None:
            return _read(rank_path(self.folder, self.rank, "fatal.txt"))
        path = rank_path(self.folder, self.rank, "stack.txt")
        offset = os.path.getsize(path) if os.path.exists(path) else 0
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except OSError:
            return ""
        # faulthandler writes from the signal handler: wait until the dump stops growing
        stack, deadline = "", time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.1)
            latest = _read(path, offset)
            if latest and latest == stack:
                break
            stack = latest
        return stack
