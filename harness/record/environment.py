"""Stage: record. Where and with what a run ran, for every report's header and meta.json: the
torch build, the CPU kernel family and threads, the host, the commits, the time."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def git_commit(folder: str | os.PathLike) -> str | None:
    """HEAD of the git checkout holding `folder` (with '+dirty' where it has uncommitted
    changes), or None where there is none."""
    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_environment() -> dict[str, Any]:
    """The environment of this process, JSON-ready."""
    import torch

    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY") or None,
        "num_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS") or None,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "sp_harness_commit": git_commit(PACKAGE_DIR),
        "project_commit": git_commit(Path.cwd()),
    }


def describe(env: dict[str, Any]) -> str:
    """One line for a report header."""
    full = env.get("sp_harness_commit") or "no git"
    commit = full[:12] + ("+dirty" if full.endswith("+dirty") else "")
    kernels = env.get("cpu_capability") or "?"
    if env.get("aten_cpu_capability_env"):
        kernels += " (ATEN_CPU_CAPABILITY)"
    return (f"torch {env.get('torch')}, {kernels} kernels, {env.get('num_threads')} threads, host {env.get('host')}, "
            f"sp-harness {commit}, {env.get('timestamp')}")
