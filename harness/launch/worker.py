"""Stage: launch. The main of one rank process: join the pool's process group, serve jobs.

Started by `RankPool` as `python -m sp_harness.launch.worker SPEC_JSON`. The rank dies with the
driver (PR_SET_PDEATHSIG on Linux, EOF on its pipe otherwise). faulthandler writes the rank's
Python stack to a file the driver reads: on SIGUSR1 (the driver asks, at a timeout) and on a
fatal signal (SIGSEGV, SIGABRT, ... in native code), where nothing else would say where it was.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Client

from sp_harness.launch import announce
from sp_harness.launch.case_setup import setup_once
from sp_harness.launch.failure import JobError, module_of
from sp_harness.launch.wire import (
    Hello,
    Job,
    JobDone,
    JobRaised,
    Ready,
    Shutdown,
    StartFailed,
    WorkerSpec,
    resolve,
)

START_TIMEOUT_S = 120.0


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _is_unsupported(exc: BaseException) -> bool:
    # imported here, not at the top: the launch stage only needs the case API when a job raised
    from sp_harness.config.case import Unsupported

    return isinstance(exc, Unsupported)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else ""


def run_job(job: Job) -> JobDone | JobRaised:
    """Run one job in this process; its outcome as the reply message."""
    announce.reset_phase()
    try:
        return JobDone(job_id=job.job_id, result=resolve(job.fn_ref)(job.payload))
    except JobError as exc:
        return JobRaised(job_id=job.job_id, exc_type=type(exc).__name__, traceback=f"{type(exc).__name__}: {exc}",
                         message=_first_line(exc), at=time.time(), phase=announce.current_phase())
    except KeyboardInterrupt:
        raise  # Ctrl-C under torchrun: the user's to stop the run (a pool rank ignores SIGINT)
    except SystemExit as exc:  # the job asked to exit: reported as an exit with its code, the process lives on
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return JobRaised(job_id=job.job_id, exc_type="SystemExit", traceback=traceback.format_exc(),
                         message=str(exc.code) if exc.code is not None else "", at=time.time(), exit_code=code,
                         phase=announce.current_phase())
    except BaseException as exc:
        return JobRaised(job_id=job.job_id, exc_type=type(exc).__name__, traceback=traceback.format_exc(),
                         is_unsupported=_is_unsupported(exc), message=_first_line(exc), at=time.time(),
                         module=module_of(exc), phase=announce.current_phase())


def warm_up(_: object = None) -> int:
    """What every first job would otherwise pay against its own timeout: DTensor's imports (sympy
    among them, seconds on a loaded machine), torch._dynamo's (a module's first construction
    imports it), the case registry, and a first collective."""
    import torch
    import torch.distributed.tensor.parallel  # noqa: F401

    torch.nn.Linear(1, 1)

    from sp_harness.config.registry import all_cases
    from sp_harness.launch import companion

    # a check's reference process, importing meanwhile; waited for, so that its start-up is the
    # pool's (on the start-up budget), never a job's: on a loaded machine it takes as long as the
    # rank's own (a 2-rank start under load 7: 8.6 s without it, 15-17 s with)
    companion.start()
    all_cases()
    companion.ready()
    return health_check()


def run_setup(case_name: str) -> bool:
    """A case's per-process setup (`Case.setup`), once per process: the pool's setup job, before the
    case's first job there; its reference process runs it on opening the case."""
    from sp_harness.launch import companion

    if setup_once(case_name):
        companion.set_up(case_name)
    return True


def health_check(_: object = None) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _join_group(spec: WorkerSpec) -> None:
    import torch
    import torch.distributed as dist

    options = spec.options
    threads = options.num_threads
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else 1
    torch.set_num_threads(threads)
    if options.devices is not None:
        torch.cuda.set_device(options.devices[spec.rank])
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    dist.init_process_group(options.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=600))


def main(spec: WorkerSpec) -> None:
    _set_pdeathsig()
    # ranks import what the driver would: its path first, before any case module is loaded
    sys.path[:] = list(spec.sys_path) + [p for p in sys.path if p not in spec.sys_path]
    conn = Client(spec.address, authkey=bytes.fromhex(os.environ["SP_HARNESS_AUTHKEY"]))
    conn.send(Hello(rank=spec.rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    # kept open for the life of the process: faulthandler writes to the descriptor from a handler
    stack_file = open(spec.stack_path, "w")
    fatal_file = open(spec.fatal_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=fatal_file, all_threads=True)
    try:
        _join_group(spec)
        conn.send(Ready())
    except BaseException as exc:
        conn.send(StartFailed(exc_type=type(exc).__name__, traceback=traceback.format_exc()))
        return
    _serve(conn)
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _serve(conn) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(msg, Shutdown):
            return
        if not isinstance(msg, Job):
            # a protocol bug: exiting shows it (the driver reports the exit and this output)
            raise TypeError(f"rank got an unexpected message: {msg!r}")
        # the job's collectives and progress go to the driver on this pipe, before its reply
        announce.open_job(conn, msg.job_id)
        try:
            reply = run_job(msg)
        finally:
            announce.close_job()
        conn.send(reply)


if __name__ == "__main__":
    main(WorkerSpec.from_json(sys.argv[1]))
