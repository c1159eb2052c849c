"""Stage: step. What the framework integrations share."""

from __future__ import annotations

import fcntl
import os
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

from sp_harness.config.case import Unsupported
from sp_harness.config.check_config import CheckConfig

T = TypeVar("T")

FLOCK_NAME = "sp_harness.flock"
"""Our lock file, beside torch's `lock` in an extension's build dir. Never removed: a builder
waiting on the old inode would then share the lock with one that opened a new file."""


def require_tp(cfg: CheckConfig, tp: int | None, name: str, framework: str) -> int:
    """The run's TP degree (world size / dp); Unsupported naming both where a case built for TP
    `tp` (None: any) meets a run at another."""
    run_tp = cfg.world_size // cfg.dp
    if tp is not None and run_tp != tp:
        raise Unsupported(f"{name} is {framework} at TP {tp}; this run has TP {run_tp} "
                          f"(world size {cfg.world_size}, dp {cfg.dp})")
    return run_tp


def extension_build_dir(name: str) -> str | None:
    """Where `torch.utils.cpp_extension.load(name=...)` builds (torch's own rule, so
    TORCH_EXTENSIONS_DIR is honoured; created if missing); None where this torch lacks it."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    return _get_build_directory(name, verbose=False)


def build_extension_exclusively(name: str, build: Callable[[], T]) -> T:
    """`build()` (which JIT-builds torch extension `name`) under an exclusive `fcntl.flock` on
    `<build dir>/sp_harness.flock`, first clearing a stale torch build lock; returns its result.

    torch guards a JIT build with a `lock` file it creates O_EXCL and removes when done; every
    other builder spins while it exists, forever if its creator was killed mid-build. The kernel
    drops a flock when its holder dies, however it dies, so ours never goes stale. Holding it,
    a `lock` that exists was left by a dead builder (every sp-harness builder takes the flock
    first), so it is removed with a warning. Misjudged: a builder outside sp-harness on this
    machine building the same extension at the same moment (its `lock` is removed under it, and
    the two builds race as if torch had no lock). Where torch's build dir cannot be found, the
    build runs unguarded."""
    build_dir = extension_build_dir(name)
    if build_dir is None:
        return build()
    fd = os.open(os.path.join(build_dir, FLOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another sp-harness process builds
        stale = os.path.join(build_dir, "lock")
        try:
            age = time.time() - os.stat(stale).st_mtime
            os.remove(stale)
        except FileNotFoundError:
            pass  # the usual case: no build was killed
        else:
            warnings.warn(f"removed a stale torch extension build lock {stale} ({age:.0f} s old) left by a "
                          f"build that was killed mid-build; building {name} now", stacklevel=2)
        return build()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a child forked during the build shares the descriptor
        os.close(fd)
