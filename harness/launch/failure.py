"""Stage: launch. How a job failed, per rank, as data: `RankError` and `RankFailure`.

Callers decide on the fields (`kind`, `exc_type`, `is_unsupported`, `signal_name`), never on text;
the text (`describe`, `summary_line`) is for people. The one place that reads text is
`stack_frames`: a faulthandler dump is only available as text, so its parsing lives here and nowhere
else.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from sp_harness.launch.wire import STEPS, Collective

ErrorKind = Literal["desync", "raised", "exited", "signal", "timeout"]

# root causes first: a desync explains the crash or abort it leads to (gloo's size enforce), a
# rank that died explains the others' secondary 'connection reset' errors, and any error
# explains a hang elsewhere
_KIND_ORDER = {"desync": -1, "signal": 0, "exited": 0, "raised": 1, "timeout": 2}


class JobError(Exception):
    """Raised inside a rank to report a failure whose traceback is noise (a clean message)."""


@dataclass(kw_only=True, frozen=True)
class RankError:
    """What went wrong on one rank."""

    rank: int
    kind: ErrorKind
    """'raised': the job raised; 'exited': the process ended without a result; 'signal': the
    process was killed by a signal; 'timeout': the rank did not answer in time; 'desync': the
    rank's collectives do not pair up with another rank's (sp_harness.launch.desync)."""
    exc_type: str = ""
    """For 'raised': the exception's class name, e.g. 'RuntimeError'."""
    is_unsupported: bool = False
    """For 'raised': the exception is the case API's `Unsupported`."""
    exit_code: int | None = None
    """For 'exited' and 'signal': the process's return code (negative: minus the signal number)."""
    signal_name: str = ""
    """For 'signal': e.g. 'SIGSEGV'."""
    traceback: str = ""
    """For 'raised': the Python traceback. For 'signal' and 'timeout': the rank's Python stack as
    faulthandler dumped it (innermost frame first)."""
    log_tail: str = ""
    """For 'exited' and 'signal': the last lines the rank printed (a C++ abort prints only there)."""
    detail: str = ""
    """What happened where no traceback tells it, e.g. 'did not connect' while starting; for
    'desync' without a collective, where the rank was instead (finished, blocked elsewhere)."""
    collective: Collective | None = None
    """For 'desync': the collective this rank announced at the position where the other rank's
    differs; None where it announced none there (see `detail`). For 'signal' and 'exited': the
    last collective it announced (a gloo abort kills the rank inside one), None if none."""
    module: str = ""
    """For 'raised': the innermost module of the sharded model running when it raised, with its
    phase ('blocks.0.attn.core (backward)'); '' where none was tracked."""
    message: str = ""
    """For 'raised': the first line of the exception's own message."""
    at: float = 0.0
    """Wall-clock time of the failure on the rank (a raise) or when the driver saw it (a
    process that ended), 0 where unknown: among failures of one kind, the first is the cause,
    the later ones (a peer's 'Connection reset by peer') its consequences."""
    phase: str = ""
    """The job's phase when the rank failed (sp_harness.launch.announce.phase): a setup phase
    ('building the reference', 'shard()', ...), `wire.STEPS`, or '' for a job that marks none."""

    @property
    def in_setup(self) -> bool:
        """The rank failed before the code under test ran its first step: in a phase the job
        marked before `STEPS` (a job that marks no phase is never judged to be setting up)."""
        return self.phase not in ("", STEPS)

    @property
    def blocked_in_collective(self) -> bool:
        """A hung rank whose innermost frames are inside a collective: waiting for a culprit."""
        return self.kind == "timeout" and any("torch/distributed" in f or "c10d" in f
                                              for f in stack_frames(self.traceback)[:4])

    @property
    def abort_message(self) -> str:
        """For a rank that died in C++ (a signal or an exit): the exception its runtime printed on
        the way out, from its output's last lines (gloo's `enforce fail`, c10's `Check failed`),
        as `type: message`; '' if it printed none. The one line that says why, where the
        faulthandler stack says only where."""
        rows = [r.strip() for r in self.log_tail.splitlines() if r.strip()]
        for i in range(len(rows) - 1, -1, -1):
            row = rows[i]
            if "what():" in row:
                text = row.split("what():", 1)[1].strip()
            elif "Check failed:" in row:
                text = "Check failed: " + row.split("Check failed:", 1)[1].strip()
            else:
                continue
            text = re.sub(r"^\[enforce fail at [^\]]*\]\s*", "", text)
            thrown = next((m.group(1) for r in reversed(rows[:i + 1]) if (m := re.search(r"instance of '([^']+)'", r))),
                          "")
            return f"{thrown}: {text}" if thrown else text
        return ""

    @property
    def innermost_frame(self) -> str:
        frames = stack_frames(self.traceback)
        return frames[0] if frames else ""

    def headline(self) -> str:
        if self.kind == "desync":
            return "desync: " + self.desync_where()
        last = f" (its last collective: {self.collective.describe()})" if self.collective else ""
        setting_up = self.setting_up()
        if self.kind == "signal":
            return f"killed by {self.signal_name}{setting_up}{last}"
        if self.kind == "exited":
            return f"exited with code {self.exit_code}{setting_up}{last}"
        if self.kind == "raised":
            inside = f" in {self.module}" if self.module else ""
            return f"raised {self.exc_type}{inside}{setting_up}" + (f": {self.message}" if self.message else "")
        return self.detail or "hung"

    def setting_up(self) -> str:
        """' while setting up (<phase>)' for a failure in setup, else ''."""
        return f" while setting up ({self.phase})" if self.in_setup else ""

    def desync_where(self) -> str:
        """For 'desync': the collective it issued, or where it was instead."""
        return f"issued {self.collective.describe()}" if self.collective else self.detail

    def describe(self) -> str:
        parts = [f"--- rank {self.rank}: {self.headline()} ---"]
        if self.detail and self.kind not in ("timeout", "desync"):
            parts.append(self.detail)
        if self.traceback.strip():
            if self.kind == "signal":
                parts.append("its Python stack at the crash (faulthandler):")
            elif self.kind == "timeout":
                parts.append("its Python stack at the timeout (faulthandler):")
            elif self.kind == "desync":
                parts.append("its Python stack when the desync was found (faulthandler):")
            parts.append(self.traceback.rstrip())
        elif self.kind in ("signal", "timeout") and not self.detail:
            parts.append("(no Python stack available)")
        if self.log_tail.strip():
            parts.append("last lines of its output:\n" + self.log_tail.rstrip())
        return "\n".join(parts)


def stack_frames(stack: str) -> list[str]:
    """The 'File ...' lines of a faulthandler dump or traceback, in their listed order."""
    return [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File ")]


def waiting_in_collective(stack: str) -> bool:
    """Whether a faulthandler dump (innermost frame first) shows a rank waiting for a collective
    to complete: c10d's blocking calls and the functional collectives' wait. Narrower than
    `blocked_in_collective`: DTensor's own Python (sharding propagation, seconds on a first call)
    also lives under torch/distributed, and there the rank is computing, not waiting."""
    return any("distributed_c10d.py" in f or "_functional_collectives.py" in f for f in stack_frames(stack)[:3])


def process_ended(rank: int, returncode: int | None, *, stack: str = "", log_tail: str = "",
                  detail: str = "") -> RankError:
    """The error for a rank process that ended without a result: killed by a signal, or exited."""
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return RankError(rank=rank, kind="signal", exit_code=returncode, signal_name=name, traceback=stack,
                         log_tail=log_tail, detail=detail)
    return RankError(rank=rank, kind="exited", exit_code=returncode, log_tail=log_tail, detail=detail)


class RankFailure(Exception):
    """A job failed on one or more ranks: raised, timed out, or the rank process died."""

    def __init__(self, label: str, errors: Iterable[RankError], timeout_s: float | None = None, rule: str = ""):
        """`rule`: for a hang the pool judged before the timeout (sp_harness.launch.activity.Liveness),
        which rule fired and what it saw; it leads the message, and `timeout_s` is then the job's
        time so far."""
        self.label = label
        self.rule = rule
        # stable: within a kind, the order the caller saw them in (the first to fail first)
        # the first to fail first: by kind (a dead rank explains its peers' errors), then by the
        # time each failed (a raise before the peer's 'connection reset' it causes)
        self.errors: tuple[RankError, ...] = tuple(sorted(
            errors, key=lambda e: (_KIND_ORDER[e.kind], e.blocked_in_collective, e.at or float("inf"))))
        if not self.errors:
            raise ValueError("a RankFailure needs at least one RankError")
        self.timeout_s = timeout_s
        super().__init__(self.describe())

    def __reduce__(self):
        return (type(self), (self.label, self.errors, self.timeout_s, self.rule))

    @property
    def kind(self) -> ErrorKind:
        """The root cause's kind: 'desync', 'raised', 'exited', 'signal' or 'timeout'."""
        return self.errors[0].kind

    @property
    def in_setup(self) -> bool:
        """The root cause is a crash (a raise, an exit, a signal) before the code under test's
        first step: a setup that could not run (verdict ERROR), not a defect of its steps. A hang
        or a collective desync stays the code's own, wherever it happens: its collectives did not
        pair up, or it never finished."""
        first = self.errors[0]
        return first.kind in ("raised", "exited", "signal") and first.in_setup

    def every_rank_unsupported(self, world_size: int) -> bool:
        """Every rank of the world raised `Unsupported`: the case declared the config out of
        reach (one rank alone may be a symptom of a bug)."""
        return len(self.errors) == world_size and all(e.is_unsupported for e in self.errors)

    @property
    def first_rank(self) -> int:
        return self.errors[0].rank

    @property
    def ranks(self) -> list[int]:
        return [e.rank for e in self.errors]

    @property
    def waiting(self) -> list[int]:
        """Hung ranks that are only blocked in a collective, waiting for the culprits."""
        return [e.rank for e in self.errors if e.blocked_in_collective]

    @property
    def culprits(self) -> list[int]:
        blocked = set(self.waiting)
        return [r for r in self.ranks if r not in blocked] or self.ranks

    def describe(self, *, with_traces: bool = True) -> str:
        head = f"{self.label}: {self._what()}"
        if not with_traces:
            return head
        return "\n".join([head] + [e.describe() for e in self.errors])

    def _what(self) -> str:
        if self.kind == "desync":
            ranks = [e for e in self.errors if e.kind == "desync"]
            return ("collective desync" + self.errors[0].setting_up() + ": "
                    + "; ".join(f"rank {e.rank} {e.desync_where()}" for e in ranks))
        if self.kind == "timeout":
            what = f"timed out after {self.timeout_s:g}s; rank(s) {_join(self.culprits)} did not finish"
            if self.rule:
                what = f"{self.rule}: {what}"
            what += self.errors[0].setting_up()
            waiting = [r for r in self.ranks if r not in self.culprits]
            if waiting:
                what += f" (rank(s) {_join(waiting)} blocked in a collective, waiting for them)"
            return what
        first, rest = self.errors[0], self.errors[1:]
        what = f"rank {first.rank} {first.headline()}"
        if rest:
            what += "; after it, " + "; ".join(f"rank {e.rank} {_short(e)}" for e in rest)
        return what

    def one_line(self) -> str:
        """What happened and its cause in one line: the header (which rank failed first and how,
        the others after it), then where the header does not already carry it, the first
        rank's own error line or frame."""
        first = self.errors[0]
        head = self.describe(with_traces=False)
        return head if first.kind == "raised" and first.message else f"{head}: {self.summary_line()}"

    def summary_line(self) -> str:
        """The exception (last traceback line); for a hang or a signal, the culprit's innermost
        frame; for an exit, the rank's last output line."""
        first = self.errors[0]
        if first.kind == "desync":
            frame = first.innermost_frame
            return f"rank {first.rank} at {frame}" if frame else first.headline()
        if first.kind == "signal" and first.abort_message:
            frame = first.innermost_frame
            return f"rank {first.rank}: {first.abort_message}" + (f" (at {frame})" if frame else "")
        if first.kind in ("timeout", "signal"):
            rank = self.culprits[0] if first.kind == "timeout" else first.rank
            frame = next(e for e in self.errors if e.rank == rank).innermost_frame
            return f"rank {rank} at {frame}" if frame else first.detail or "no stack available"
        if first.kind == "exited" and first.abort_message:
            return f"rank {first.rank}: {first.abort_message}"
        if first.kind == "exited":
            rows = first.log_tail.strip().splitlines()
            return f"rank {first.rank}: " + (rows[-1] if rows else first.detail or f"exit code {first.exit_code}")
        if first.message:
            return f"rank {first.rank}: {first.exc_type}: {first.message}"
        rows = first.traceback.strip().splitlines()
        return f"rank {first.rank}: " + (rows[-1] if rows else first.exc_type)


def _short(error: RankError) -> str:
    """A secondary failure in a few words: its kind and exception class, not its message."""
    return f"raised {error.exc_type}" if error.kind == "raised" else error.headline()


def raised(rank: int, msg) -> RankError:
    """The error for a rank's `JobRaised` reply (or a torchrun rank's): a SystemExit is an exit
    with its code, anything else a raise."""
    if msg.exit_code is not None:
        return RankError(rank=rank, kind="exited", exit_code=msg.exit_code, traceback=msg.traceback,
                         detail=f"the job called sys.exit({msg.message or msg.exit_code})", at=msg.at,
                         phase=msg.phase)
    return RankError(rank=rank, kind="raised", exc_type=msg.exc_type, is_unsupported=msg.is_unsupported,
                     traceback=msg.traceback, message=msg.message, at=msg.at, module=msg.module, phase=msg.phase)


_MODULE_ATTR = "_sp_harness_module"


def mark_module(exc: BaseException, module: str) -> None:
    """Tags `exc`, raised inside the sharded model, with the module it was raised in (the
    innermost one running: `ModuleWhere.now()`); the rank's reply carries it (`module_of`)."""
    if module and not hasattr(exc, _MODULE_ATTR):
        setattr(exc, _MODULE_ATTR, module)


def module_of(exc: BaseException) -> str:
    return getattr(exc, _MODULE_ATTR, "")


def _join(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))


class SetupError(ValueError):
    """A case's per-process setup (`Case.setup`) raised or ran past its budget on some rank: a
    setup problem, never a verdict on the code under test. A check reports it as its verdict
    ERROR (sp_harness.checks.side_by_side.run_job); where nothing turns it into a verdict it is a
    ValueError: one line, exit 2."""

    def __init__(self, message: str, failure: RankFailure | None = None):
        super().__init__(message)
        self.failure = failure
        """The ranks' failure in the setup, where it came from ranks."""

    def __reduce__(self):
        return (type(self), (str(self), self.failure))

    @classmethod
    def of(cls, case: str, failure: RankFailure) -> SetupError:
        return cls(f"case {case}: its setup failed, so nothing was checked ({failure.summary_line()})", failure)

    def unsupported(self, world_size: int) -> str:
        """Where every rank raised `Unsupported` in the setup (its framework broken at import:
        sp_harness.launch.case_setup.load_preload), that message; else ''."""
        failure = self.failure
        return failure.errors[0].message if failure is not None and failure.every_rank_unsupported(world_size) else ""
