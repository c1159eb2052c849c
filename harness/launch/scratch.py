"""Stage: launch. A pool's scratch folder in the machine's temp dir, and the sweep of folders whose owner died.

A pool removes its folder on close() or at interpreter exit, but a driver killed by SIGKILL (the
OOM killer, `pkill -9`, a CI runner's hard timeout) runs neither, and its folder of rank logs and
stack dumps stayed in /tmp. The owner therefore holds an exclusive flock on a file inside its
folder for as long as the folder is in use; the kernel drops the lock when the process dies,
however it dies. The next pool started on the machine removes every folder whose lock it can
take. A lock works across PID namespaces sharing the folder (where a pid check would not), and a
folder being made is never taken: its lock file appears, already locked, by a rename."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

try:
    import fcntl
except ImportError:  # no flock (Windows): folders are still removed by their owner's close()
    fcntl = None  # type: ignore[assignment]

PREFIX = "sp-harness-stacks-"
LOCK_NAME = "owner.lock"


class ScratchDir:
    """A fresh folder under `root` (the temp dir), owned (locked) by this process until `remove()`."""

    def __init__(self, prefix: str = PREFIX, root: str | None = None):
        self.path = tempfile.mkdtemp(prefix=prefix, dir=root)
        self._fd: int | None = None
        if fcntl is not None:
            staging = os.path.join(self.path, LOCK_NAME + ".new")
            fd = os.open(staging, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(staging, os.path.join(self.path, LOCK_NAME))
            self._fd = fd

    def remove(self) -> None:
        """Removes the folder, then lets go of the lock. Runs once."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sweep_orphans(prefix: str = PREFIX, root: str | None = None) -> list[str]:
    """Removes the folders `prefix`* under `root` (the temp dir) whose owner is gone: their lock
    file is free. Folders without one (being made, or another user's we cannot open) are left.
    Returns the folders removed."""
    if fcntl is None:
        return []
    removed = []
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), glob.escape(prefix) + "*")):
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its owner is alive
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
