"""Stage: launch. Starting a pool's rank processes within the start-up budget (`START_TIMEOUT_S`,
not a job's timeout): each forked from the zygote or started as a fresh interpreter, then
connected to the driver and through rendezvous.

Every rank connects to the driver's listener with the pool's auth key, says `Hello`, joins the
process group on the driver's TCPStore and says `Ready` (or `StartFailed` with its traceback). A
rank that ends, or does not get there within the budget, fails the start as a `RankFailure`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Listener
from typing import IO, Any

from sp_harness.launch.failure import RankError, RankFailure
from sp_harness.launch.rank_probe import RankProbe
from sp_harness.launch.wire import Hello, Ready, StartFailed, WorkerSpec
from sp_harness.launch.worker import START_TIMEOUT_S
from sp_harness.launch.zygote import RankProcess, Zygote, ZygoteError


def import_path() -> list[str]:
    """The driver's import path, absolute: what its case files and their imports resolve against
    (pytest's `pythonpath`, a src layout, the directory of a user's case file)."""
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


def spawn_rank(spec: WorkerSpec, *, log_path: str, env: dict[str, str],
               forks: Zygote | None) -> tuple[subprocess.Popen | RankProcess, IO[str] | None]:
    """The rank process of `spec`, forked by `forks` where it can, and the log file the driver
    opened for it (None for a forked rank, which opens its own)."""
    if forks is not None:
        try:
            return forks.spawn(spec.to_json(), log_path=log_path, env=env, cwd=os.getcwd()), None
        except ZygoteError:
            pass  # it died or could not fork: this rank starts as a fresh interpreter instead
    # rank output goes to a per-rank log; its tail is attached to failures (a C++ abort such
    # as gloo's size-mismatch enforce is only ever printed there)
    log = open(log_path, "w")
    # a plain subprocess, not multiprocessing's spawn: spawn re-imports the caller's __main__,
    # which a library must not require to be import-safe
    # its own session: a rank's children (its reference process, a compiler a framework starts)
    # are killed with it as one process group, and the terminal's Ctrl-C is the driver's alone
    try:
        return subprocess.Popen([sys.executable, "-m", "sp_harness.launch.worker", spec.to_json()], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True), log
    except BaseException:
        log.close()
        raise


def connect(listener: Listener, conns: list[Any], probes: list[RankProbe], deadline: float, label: str) -> None:
    """Accepts each rank's connection into its slot of `conns` (filled in place: on a failure the
    pool closes those that came)."""
    # wake up to notice ranks that died: accept() has no timeout of its own, so the private socket's
    # (typeshed does not declare Listener's private attributes)
    listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
    while any(c is None for c in conns):
        if time.monotonic() > deadline:
            raise RankFailure(label, [RankError(rank=r, kind="timeout", detail="did not connect")
                                      for r, c in enumerate(conns) if c is None], START_TIMEOUT_S)
        dead = [p.ended(detail="ended while starting") for p in probes if p.proc.poll() is not None]
        if dead:
            raise RankFailure(label, dead)
        try:
            conn = listener.accept()
        except (socket.timeout, TimeoutError):
            continue
        hello = conn.recv()
        if not isinstance(hello, Hello):
            raise TypeError(f"rank process sent {hello!r} instead of Hello")
        conns[hello.rank] = conn


def await_ready(conns: list[Any], probes: list[RankProbe], deadline: float, label: str) -> None:
    """Waits for every rank's `Ready`: the process group is up on all of them."""
    for rank, conn in enumerate(conns):
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise RankFailure(label, [RankError(rank=rank, kind="timeout", detail="rendezvous did not complete")],
                              START_TIMEOUT_S)
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            raise RankFailure(label, [probes[rank].ended(detail="ended while starting")]) from None
        if isinstance(msg, StartFailed):
            raise RankFailure(label, [RankError(rank=rank, kind="raised", exc_type=msg.exc_type,
                                                traceback=msg.traceback)])
        if not isinstance(msg, Ready):
            raise TypeError(f"rank {rank} sent {msg!r} instead of Ready")
