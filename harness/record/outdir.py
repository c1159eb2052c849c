"""Stage: record. Report directories that two runs can never mix.

`--out D` names a stable path that users open (`D/report.html`), but no run writes into it:
each run writes its own fresh directory `D.runs/<UTC time>-<pid>/`, and only when that run is
complete is `D` pointed at it, by an atomic symlink swap. Two runs at once leave two intact run
directories (D shows the one that finished last); a run that dies leaves D on the last
complete one; nothing of an earlier run is ever shown as this run's. A `D` from before this
layout (a plain directory holding an earlier report, or an empty one) is moved into `D.runs/`
first; any other existing `D` is a usage error. The newest KEEP complete runs are kept.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

KEEP = 20
"""Complete runs kept per report directory (the nightly history reads them)."""
COMPLETE = ".complete"
"""Marker a run directory gets when it is published: only complete runs are ever pruned."""
REPORT_FILES = ("meta.json", "summary.json", "report.html", "checks.json")
"""Any of these marks a plain directory as an earlier sp-harness report."""


@dataclass(frozen=True)
class RunDir:
    link: Path
    """What the user named: after `publish`, a symlink to `path`."""
    path: Path
    """This run's own directory; everything the run writes goes here."""

    def abandon(self) -> None:
        """Removes this unpublished run (an interrupted or crashed run leaves nothing behind;
        `--out` still shows the last complete one)."""
        if not (self.path / COMPLETE).exists():
            shutil.rmtree(self.path, ignore_errors=True)
            try:
                self.path.parent.rmdir()  # only if no other run is there
            except OSError:
                pass

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abandon()

    def publish(self) -> Path:
        """Points `link` at this run, atomically (a symlink made beside it, renamed over it),
        marks the run complete and prunes the oldest complete runs. Returns `link`."""
        (self.path / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")
        tmp = self.link.parent / f".{self.link.name}.{os.getpid()}.link"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(os.path.relpath(self.path, self.link.parent), tmp)
        os.replace(tmp, self.link)
        _prune(self.path.parent, keep_also=self.path)
        return self.link


def runs_root(link: Path) -> Path:
    return link.parent / (link.name + ".runs")


def open_run_dir(out: str | os.PathLike) -> RunDir:
    """A fresh directory for one run reported at `out` (ValueError, exit 2, where `out` exists
    and is neither a link made here nor an earlier report)."""
    check_out(out)
    link = Path(out)
    root = runs_root(link)
    if link.exists() and not link.is_symlink():
        root.mkdir(parents=True, exist_ok=True)
        try:  # an earlier layout's report: kept as a complete run of its own
            adopted = root / f"earlier-{_stamp()}-{os.getpid()}"
            os.rename(link, adopted)
            (adopted / COMPLETE).write_text("adopted\n")
        except FileNotFoundError:
            pass  # another run moved it first
    path = root / f"{_stamp()}-{os.getpid()}"
    path.mkdir(parents=True)
    return RunDir(link=link, path=path)


def check_out(out: str | os.PathLike) -> None:
    """The usage errors `open_run_dir` raises (ValueError, exit 2), before any work: `out` is
    neither absent, a link made here, nor an earlier report; its folder cannot be made or written."""
    link = Path(out)
    if link.exists() and not link.is_symlink():
        if not link.is_dir() or (any(link.iterdir()) and not any((link / f).exists() for f in REPORT_FILES)):
            raise ValueError(f"--out {str(out)!r} exists and is not an sp-harness report directory "
                             f"(no {', '.join(REPORT_FILES)}): name a new or report directory")
    parent = link.parent if str(link.parent) else Path(".")
    try:  # the folder that will hold the link and the runs (made now, as the run would)
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} cannot be written ({exc.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {str(out)!r} cannot be written ({parent} is not writable)")
    # access() says yes to root for folders no one can make entries in (/proc): make one, as the
    # run will (its runs folder), and take it away again
    try:
        probe = Path(tempfile.mkdtemp(prefix=f".{link.name}.", suffix=".probe", dir=parent))
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r} cannot be written ({exc.strerror}: {runs_root(link)})") from None
    probe.rmdir()


def _prune(root: Path, keep_also: Path) -> None:
    done = sorted((d for d in root.iterdir() if (d / COMPLETE).exists()), key=lambda d: d.stat().st_mtime)
    for old in done[:-KEEP]:
        if old != keep_also:
            shutil.rmtree(old, ignore_errors=True)


def _stamp() -> str:
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1e6) % 1_000_000:06d}Z"
