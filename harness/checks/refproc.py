"""Stage: checks. Rank side: the rank's reference process: where a side-by-side check's
references are built and computed, apart from the code under test.

A child of the rank process, started while the pool warms up (its start-up is pool start-up,
never a job's) and kept for the rank's life. It runs in a one-rank world of
its own (its own process group, its own framework globals), imports the case by name, builds the
three references from the case's factory with a single-device rank context, and never calls the
sharded factory: what that factory registers process-wide, in the rank, cannot reach a reference.

Messages are frozen dataclasses pickled over a socket pair; tensors travel by value. The child is
the rank's companion (sp_harness.launch.companion): started while the pool warms up, it dies with
the rank and shares its process group (a timeout's kill takes both).
"""

from __future__ import annotations

import atexit
import io
import pickle
import subprocess
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, overload

import torch

from sp_harness.capture.trace import Trace
from sp_harness.checks.references import LinearPiece, RefResult, make_references
from sp_harness.config.case import Batch
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.launch import companion
from sp_harness.step.inputs import batch_to


@dataclass(kw_only=True, frozen=True)
class Open:
    """Build the references of one job: the case by name, the reference's exact state."""

    config: CheckConfig
    state: dict[str, Any]
    """The rank's float64 reference's state_dict: the child's references start from it exactly."""
    device: str
    sys_path: tuple[str, ...]
    num_threads: int
    """The rank's intra-op threads: the same kernels' split as the rank would use."""


@dataclass(kw_only=True, frozen=True)
class Compute:
    kinds: tuple[str, ...]
    full: dict[str, torch.Tensor]
    batch: Batch
    pieces: tuple[LinearPiece, ...] = ()


@dataclass(kw_only=True, frozen=True)
class TraceAll:
    full: dict[str, torch.Tensor]
    batch: Batch
    skip: frozenset[str]


@dataclass(kw_only=True, frozen=True)
class Failed:
    """The child raised: its traceback, shown as the rank's."""

    traceback: str


class ReferenceProcessError(RuntimeError):
    """The reference process raised or died: a harness or case-factory problem, reported with its
    own traceback."""


class ReferenceProcess:
    """The rank side: one child process, serving one job's references at a time."""

    def __init__(self):
        # a companion started with the pool (sp_harness.launch.companion): its torch import is done
        served = companion.take(serve)
        self.proc, self.conn = served.proc, served.conn
        self._waiting = False

    def call(self, msg: Any) -> Any:
        self.send(msg)
        return self.receive()

    def send(self, msg: Any) -> None:
        try:
            self.conn.send_bytes(dumps(msg))
        except OSError:  # a broken pipe: it died since its last reply (the OOM killer, a kill)
            raise self._died() from None
        self._waiting = True

    def receive(self) -> Any:
        try:
            reply = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self._died() from None
        finally:
            self._waiting = False
        if isinstance(reply, Failed):
            raise ReferenceProcessError("the reference process raised:\n" + reply.traceback)
        return reply

    def _died(self) -> ReferenceProcessError:
        """How the process ended, for the user: a signal's number (9: killed, as by the OOM
        killer) or its exit code."""
        code = self.proc.wait(timeout=10)
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        return ReferenceProcessError(f"the reference process died ({how}); its output is in the rank's log")

    def drain(self) -> None:
        """Take a reply still on its way (a job that raised between send and receive)."""
        if self._waiting:
            try:
                self.receive()
            except ReferenceProcessError:
                pass  # that job is over; a dead process is replaced by the caller

    def close(self) -> None:
        try:
            self.conn.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _rebuild(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty_strided(shape, stride, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).as_strided(shape, stride)


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a run of its storage with no gap or overlap, in some order of
    its dims (a contiguous tensor, or a permutation of one)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Pickler(pickle.Pickler):
    """pickle, with a plain dense CPU tensor sent as its bytes, dtype, shape and strides: torch's
    own pickling goes through torch.save's format per tensor, 6.6 ms to write and 6.8 ms to read
    52 small float64 tensors against 0.7 and 0.5 here (under py-spy, about 100 of the suite's
    3,460 sampled seconds, a tenth of the reference processes' own). The values, strides and dtype arrive as they left; the storage
    offset is 0, and the tensor owns its storage. Any other tensor (a subclass, one that requires
    grad, a GPU, sparse or non-dense one, a conjugate view) takes torch's own way."""

    def reducer_override(self, obj):
        if (type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.layout != torch.strided
                or obj.requires_grad or obj.is_conj() or obj.is_neg() or not _dense(obj)):
            return NotImplemented
        n = obj.numel()
        # dense: its elements fill [offset, offset + n) of its storage, in memory order
        flat = obj.as_strided((n,), (1,), obj.storage_offset())
        data = bytearray(flat.view(torch.uint8).numpy())  # one copy, owned by the pickle
        return _rebuild, (data, obj.dtype, tuple(obj.shape), tuple(obj.stride()))


def dumps(msg: Any) -> bytes:
    """`msg` pickled for the reference process's pipe (read back with pickle.loads)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return buf.getvalue()


_PROCESS: ReferenceProcess | None = None


def reference_process() -> ReferenceProcess:
    """This rank's reference process, started on first use; a dead one is replaced."""
    global _PROCESS
    if _PROCESS is not None and _PROCESS.proc.poll() is not None:
        _PROCESS = None
    if _PROCESS is None:
        _PROCESS = ReferenceProcess()
        atexit.register(_PROCESS.close)
    _PROCESS.drain()
    if _PROCESS.proc.poll() is not None:
        _PROCESS = None
        return reference_process()
    return _PROCESS


class Remote:
    """`Computes` (sp_harness.checks.references) in the rank's reference process."""

    def __init__(self, config: CheckConfig, reference: torch.nn.Module, device: torch.device):
        self.process = reference_process()
        self.process.call(Open(config=config, state=reference.state_dict(), device=str(device),
                               sys_path=tuple(sys.path), num_threads=torch.get_num_threads()))
        self.device = device

    def start(self, kinds: tuple[str, ...], full: dict[str, torch.Tensor], batch: Batch,
              pieces: tuple[LinearPiece, ...]) -> None:
        self.process.send(Compute(kinds=kinds, full=_owning(full), batch=batch, pieces=pieces))

    def finish(self) -> dict[str, RefResult]:
        return {w: _to(r, self.device) for w, r in self.process.receive().items()}

    def traces(self, full: dict[str, torch.Tensor], batch: Batch, skip: frozenset[str]) -> dict[str, Trace]:
        return self.process.call(TraceAll(full=_owning(full), batch=batch, skip=skip))


# ---------------------------------------------------------------- the child


class _Server:
    def __init__(self):
        self.refs = None
        self.case = None
        self.device = torch.device("cpu")

    def handle(self, msg: Any) -> Any:
        if isinstance(msg, Open):
            return self.open(msg)
        if isinstance(msg, Compute):
            return {w: _to(self.refs.compute(w, _on(msg.full, self.device), self.case, batch_to(msg.batch, self.device),
                                             msg.pieces), "cpu") for w in msg.kinds}
        if isinstance(msg, TraceAll):
            full, batch = _on(msg.full, self.device), batch_to(msg.batch, self.device)
            return {w: self.refs.trace(w, full, self.case, batch, msg.skip) for w in ("r64", "lp", "alt")}
        raise TypeError(f"reference process got an unexpected message: {msg!r}")

    def open(self, msg: Open) -> bool:
        from sp_harness.launch.worker import run_setup
        from sp_harness.step.build import cast_floating, new_reference, reference_copy
        from sp_harness.step.context import reference_context

        sys.path[:] = list(msg.sys_path) + [p for p in sys.path if p not in msg.sys_path]
        torch.set_num_threads(msg.num_threads)
        self.device = torch.device(msg.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.case = get_case(msg.config.case)
        run_setup(msg.config.case)  # the case's per-process setup, once here as in the rank
        config = self.case.resolve(msg.config)
        ctx = reference_context(config, self.device)
        reference = cast_floating(new_reference(self.case, config, ctx).to(self.device), torch.float64)
        reference.load_state_dict(msg.state)
        self.refs = make_references(
            reference, lambda: reference_copy(self.case, config, ctx, reference, torch.float64, self.device),
            config, self.device)
        return True


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in a storage of its own: pickling a view pickles its whole storage, so the params the
    rank gathered into one flat buffer (sp_harness.step.anchor) went over the pipe once per
    param, each time the whole model (4 layers at hidden 256: 6 GB a step)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _owning(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: _own(v) for k, v in tensors.items()}


def _on(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tensors.items()}


@overload
def _moved(t: torch.Tensor, device: str | torch.device) -> torch.Tensor: ...


@overload
def _moved(t: None, device: str | torch.device) -> None: ...


def _moved(t: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    """`t` on `device` with no autograd graph attached (None stays None)."""
    return None if t is None else _own(t.detach().to(device))


def _to(result: RefResult, device: str | torch.device) -> RefResult:
    """A result fit to pickle: on `device`, with no autograd graph attached."""
    step = result.step
    step = type(step)(out=_moved(step.out, device), loss=_moved(step.loss, device),
                      out_grad=_moved(step.out_grad, device),
                      input_grads={k: _moved(v, device) for k, v in step.input_grads.items()},
                      lse={k: _moved(v, device) for k, v in step.lse.items()})
    return RefResult(step=step, grads={k: _moved(v, device) for k, v in result.grads.items()},
                     grad_noise=result.grad_noise)


def serve(conn: Connection) -> None:
    """The reference process's loop, in a companion of the rank (sp_harness.launch.companion)."""
    import torch.distributed as dist

    # a world of one: the references' collectives (a framework's TP=1 all-reduce) stay here
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    server = _Server()
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            reply = server.handle(msg)
        except BaseException:
            reply = Failed(traceback=traceback.format_exc())
        conn.send_bytes(dumps(reply))
