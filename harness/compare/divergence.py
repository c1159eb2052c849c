"""Stage: compare. Localising a FAIL: the first module, in execution order, whose output or input
grad left its bound (recorded by sp_harness.capture.trace); a param-grad failure with none is
placed before or after the grad sync by the grads backward left (sp_harness.compare.presync)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from sp_harness.capture.trace import Recorder, Trace
from sp_harness.compare.presync import Placement
from sp_harness.compare.tensor_check import TensorCheck
from sp_harness.compare.tolerance import RefPieces, check_tensor
from sp_harness.config import shards as sh
from sp_harness.step.precision import precision_of


@dataclass(kw_only=True)
class Divergence:
    step: int
    rank: int
    phase: str
    """'forward' (the module's output), 'backward' (its input grad), 'loss' (the first failure is
    the loss, the model's output and every traced module agree: the error enters in the loss
    computed from the output), 'sync' (the grads before the sync place it there), 'none' (every
    traced module agrees, the first failure is a param grad or update, and nothing gathered shows
    the stage it entered in: "cannot place", with what the grads before the sync said), or
    'unaligned' (the first failure is in the forward or an input grad, yet no module that could be
    compared diverged: `note` says which modules could not be and why)."""
    module: str
    ratio: float
    """max |error| / allowed at this module."""
    order: int = 0
    """Position in its phase's execution order (for picking the earliest across ranks)."""
    note: str = ""
    """For 'unaligned': the modules that could not be compared, and why."""
    upstream: tuple[str, ...] = ()
    """For 'forward': the modules that ran before this one and could not be compared (they hold
    TP-sharded params, or their output lines up with nothing): the error may enter in one of them."""
    ran_after: tuple[str, ...] = ()
    """For 'forward': the modules whose forward started after this one's ended: an op in one of
    them (or in backward, or in the loss outside the model) cannot have caused it."""
    cleared: tuple[str, ...] = ()
    """For 'forward': the compared modules whose output was within its bound before this one's
    was recorded: an op inside one of them cannot have caused it (it would have shown there)."""
    presync: str = ""
    """For 'backward', 'sync' and 'none': what the grads before the sync said (Placement.describe)."""
    declared: tuple[str, ...] = ()
    """The case's declared precision islands (module-name prefixes): the perturbed reference
    rounds every op inside one at the island's precision, so an op found inside one is no
    candidate cause (the declared island itself is named where it holds the divergence)."""
    no_grad: bool = False
    """For 'backward': no grad reached the module's input at all (where the reference's is not
    zero): its backward, or an exchange inside it, is detached."""
    param: str = ""
    """For 'backward' placed by the grads before the sync (no traced input grad diverged): the
    param whose grads fit nowhere; `module` is its module."""
    input_grad_scale: float = 1.0
    """What the sharded input grads were compared as times the reference's: 1, or the scale the
    first ones compared in backward agree on (backward_scale)."""

    def sort_key(self):
        return (self.step, PHASES.index(self.phase), self.order, self.rank)

    def describe(self) -> str:
        if self.phase == "loss":
            return (f"every traced module and the model's output are within their bounds at step {self.step} "
                    f"(rank {self.rank}): the error enters in the loss computed from the output (Sharded.local_loss)")
        if self.phase == "unaligned":
            return (f"no module could be localised at step {self.step} (rank {self.rank}): every module that lines "
                    f"up with the reference is within its bound, and {self.note}")
        if self.phase == "sync":
            return (f"the error enters in the grad sync at step {self.step} (rank {self.rank}): every traced "
                    f"module's output and input grad is within its bound, and {self.presync}")
        scaled = ""
        if self.input_grad_scale != 1.0:
            scaled = (f" (input grads compared as {self.input_grad_scale:.4g}x the reference's: the scale the first "
                      f"ones compared in backward agree on, the case's loss normalisation)")
        if self.phase == "none":
            # what was gathered rules nothing in: the output, the loss and the traced modules agree
            # only within bounds that a forward error (a bfloat16 loss's) can hide below while its
            # grads show it, and the grads before the sync name no stage
            return (f"cannot place the error at step {self.step} (rank {self.rank}): the model's output, the loss "
                    f"and every traced module's output and input grad{scaled} are within their bounds, which does "
                    f"not show the forward to be the source (an error there below what those bounds resolve is not "
                    f"ruled out), and {self.presync or 'the grads before the sync were not kept'}")
        if self.param:
            return (f"first module with wrong param grads before the grad sync: {self.module} ({self.param}, "
                    f"{self.phase}, step {self.step}, rank {self.rank}, {self.ratio:.3g}x its bound at the best fit), "
                    f"every traced module's input grad within its bound{scaled}: {self.presync}")
        what = "output" if self.phase == "forward" else "no input grad at all" if self.no_grad else "input grad"
        before = ""
        if self.upstream:
            more = f" and {len(self.upstream) - MAX_NAMED} more" if len(self.upstream) > MAX_NAMED else ""
            before = (f"; before it, not compared (TP-sharded params or no line-up), where the error may enter "
                      f"instead: {', '.join(self.upstream[:MAX_NAMED])}{more}")
        after = f"; {self.presync}" if self.presync else ""
        return (f"first diverging module: {self.module} ({what}, {self.phase}, step {self.step}, rank {self.rank}, "
                f"{self.ratio:.3g}x its bound){scaled}{before}{after}")

    def could_cause(self, module: str, backward: bool) -> bool:
        """Whether an op in `module` (in backward: `backward`) can have caused this divergence: not
        for a forward divergence where the op ran in backward, in a module that started after
        it or inside one that agreed, or in the loss outside the model; for a backward one, only a
        backward op inside the diverging module; for a sync one, none. `module` may carry a
        wrapper's prefix ('module.')."""
        if self.phase == "sync":
            return False  # a rounding in any op is within its bound before the sync
        if any(_inside(module, d) for d in self.declared):
            return False  # modelled: the whole island rounds at its precision in the reference
        if self.phase == "backward" and self.module:
            # every module output agreed, so a forward op's rounding did; in backward, a module
            # whose input grad agreed ran its backward before this one's without harm
            return backward and _inside(module, self.module)
        if self.phase != "forward" or not self.module:
            return True
        if backward or module == "loss":
            return False
        return not any(module == m or module.endswith("." + m) for m in self.ran_after) and not any(
            _inside(module, m) for m in self.cleared)


def _inside(module: str, outer: str) -> bool:
    """Whether `module` (which may carry a wrapper's prefix) is `outer` or inside it."""
    return f".{outer}." in f".{module}."


PHASES = ("forward", "backward", "loss", "sync", "unaligned", "none")
FORWARD_KINDS = frozenset({"forward", "lse", "loss"})
"""First-failure kinds whose error must have entered in the forward."""
MAX_NAMED = 4


SCALE_WITNESSES = 2
"""How many input grads, the first compared in backward, must agree on a backward scale: one
alone may be a partial sum the framework completes outside the module (a TP expert's)."""


def backward_scale(first: list[tuple[torch.Tensor, RefPieces, TensorCheck]], dtype: torch.dtype) -> float:
    """What the sharded backward is times the reference's, from the first input grads compared in
    backward (`first`: each grad, its reference pieces and its check at 1). A case may start
    backward from a multiple of the loss it reports and divide the grads in its sync: megatron's
    calculate_per_token_loss backpropagates the token sum and finalize_model_grads divides by the
    count, so every input grad is the count (22 in mcore-gpt-sp-loss's batch) times the
    reference's, and the first module compared in backward (the final norm) read 21x its bound in a
    bfloat16 run whose only bug was one param's grad (2e6x in float32). The engine does not know
    the case's loss normalisation; backward is linear in its seed, so where the first
    SCALE_WITNESSES input grads are all outside their bounds at 1 and within them at one positive
    factor (fitted on the first), that factor holds for every input grad. Else 1."""
    if len(first) < SCALE_WITNESSES or any(chk.ok for _, _, chk in first[:SCALE_WITNESSES]):
        return 1.0
    got, refs, _ = first[0]
    g, r = got.detach().to(torch.float64).reshape(-1), refs.r64.to(torch.float64).reshape(-1)
    norm = float(r @ r)
    factor = float(g @ r) / norm if norm > 0.0 else 0.0
    if not (math.isfinite(factor) and factor > 0.0):
        return 1.0
    if all(_judge_at(factor, chk, got, refs, dtype).ok for got, refs, chk in first[:SCALE_WITNESSES]):
        return factor
    return 1.0


def _judge_at(factor: float, chk: TensorCheck, got: torch.Tensor, refs: RefPieces, dtype: torch.dtype) -> TensorCheck:
    """`chk`'s tensor judged as `factor` times the reference's."""
    if factor == 1.0:
        return chk
    return check_tensor(kind=chk.kind, name=chk.name, step=chk.step, rank=chk.rank,
                        got=got.detach().to(torch.float64) / factor, refs=refs, precision=precision_of(dtype))


@dataclass(kw_only=True, frozen=True)
class Replica:
    """This rank's DP replica, to line its traced tensors up with the reference's, which holds
    every replica's rows (DP > 1)."""

    dp: int
    dp_rank: int
    batch_dim: int | None
    """The batch dim the case's output Layout declares: a traced tensor whose reference has dp
    times this rank's rows there is cut to the replica's rows (as the output is)."""
    grad_scale: float = 1.0
    """What a replica's input grads are times the reference's (each replica's loss the mean over
    its own micro-batch: global tokens / replica tokens), as the input-grad check scales them."""


def _line_up(got: torch.Tensor, ref: torch.Tensor, seq_len: int, seq_shards, tp_rank: int,
             seq_index: torch.Tensor | None = None, replica: Replica | None = None):
    """`ref` cut to `got`'s piece (whole, or this rank's slice of a sequence dim: the positions
    `seq_index` names under a permuted layout), after its DP replica's rows (`replica`), or None."""
    rows = _replica_rows(got, ref, replica)
    if rows is not None:
        inner = _line_up(got, rows(ref), seq_len, seq_shards, tp_rank, seq_index)
        return None if inner is None else lambda t: inner(rows(t))
    if got.shape == ref.shape:
        return lambda t: t
    if got.dim() != ref.dim():
        return None
    for dim in range(ref.dim()):
        if ref.shape[dim] == seq_len and got.shape[dim] == seq_shards[tp_rank] and all(
                got.shape[d] == ref.shape[d] for d in range(ref.dim()) if d != dim):
            if seq_index is not None:
                return lambda t, dim=dim: t.index_select(dim, seq_index.to(t.device))
            return lambda t, dim=dim: sh.shard(t, dim, seq_shards, tp_rank)
    return None


def _replica_rows(got: torch.Tensor, ref: torch.Tensor, replica: Replica | None):
    """The cut to this rank's DP replica's rows of the declared batch dim, where `ref` has every
    replica's there and `got` this one's; else None."""
    if replica is None or replica.dp == 1 or replica.batch_dim is None:
        return None
    dim = replica.batch_dim
    if got.dim() != ref.dim() or ref.dim() <= dim or got.shape[dim] == ref.shape[dim]:
        return None
    sizes = sh.chunk_sizes(ref.shape[dim], replica.dp)
    if sizes[replica.dp_rank] != got.shape[dim]:
        return None
    return lambda t: sh.shard(t, dim, sizes, replica.dp_rank)


def _with_missing_grads(sharded: Recorder | Trace, ref64: Recorder | Trace) -> dict[str, torch.Tensor]:
    """The sharded input grads in backward's order, with a zero grad for each traced module whose
    input needed one that never came where the reference's came: placed where the reference's
    arrived, among the sharded grads the reference has too (a module whose exchange is detached
    gets no grad; the modules around it do, through the residual)."""
    at = {name: i for i, name in enumerate(ref64.backward)}
    missing = sorted((n for n in sharded.inputs if n not in sharded.reached and n in at), key=at.__getitem__)
    merged: dict[str, torch.Tensor] = {}
    for name, grad in sharded.backward.items():
        while missing and name in at and at[missing[0]] < at[name]:
            first = missing.pop(0)
            merged[first] = _zeros(sharded.inputs[first], ref64.backward[first].device)
        merged[name] = grad
    for name in missing:
        merged[name] = _zeros(sharded.inputs[name], ref64.backward[name].device)
    return merged


def _zeros(spec: tuple[tuple[int, ...], torch.dtype], device: torch.device) -> torch.Tensor:
    shape, dtype = spec
    return torch.zeros(shape, dtype=dtype, device=device)


def _forward_divergence(step: int, rank: int, name: str, ratio: float, order: int, started: list[str],
                        not_compared: frozenset[str] | set[str], agreed: tuple[str, ...] = ()) -> Divergence:
    """A forward divergence at module `name`, placed among `started` (every module, in the order
    its forward started: its own submodules right after it); `agreed`: the compared modules whose
    output was recorded before it and agreed. An uncompared module inside one of those cannot be
    where the error enters (it would have shown at their output): it is not named upstream."""
    if name not in started:
        return Divergence(step=step, rank=rank, phase="forward", module=name, ratio=ratio, order=order,
                          cleared=agreed)
    at = started.index(name)
    end = at + 1
    while end < len(started) and started[end].startswith(name + "."):
        end += 1
    upstream = tuple(m for m in started[:at] if m in not_compared and not name.startswith(m + ".")
                     and not any(m.startswith(s + ".") for s in not_compared)
                     and not any(_inside(m, a) for a in agreed))
    return Divergence(step=step, rank=rank, phase="forward", module=name, ratio=ratio, order=order,
                      upstream=upstream, ran_after=tuple(started[end:]), cleared=agreed)


def _after_last_agreeing(candidates: list[tuple[str, str]], started: list[str],
                         agreed: list[str]) -> list[tuple[str, str]]:
    """Forward candidates in the order their forward started, those that started after the last
    compared module that agrees first (an error entering before it would most likely have reached
    it: gathered logits' loss after the final norm, say)."""
    at = {name: i for i, name in enumerate(started)}
    last = max((at[n] for n in agreed if n in at), default=-1)
    ordered = sorted(candidates, key=lambda c: at.get(c[0], len(started)))
    return [c for c in ordered if at.get(c[0], len(started)) > last] + \
        [c for c in ordered if at.get(c[0], len(started)) <= last]


def first_divergence(*, step: int, rank: int, sharded: Recorder | Trace, ref64: Recorder | Trace,
                     ref_lp: Recorder | Trace, ref_alt: Recorder | Trace, dtype: torch.dtype, seq_len: int, seq_shards, tp_rank: int,
                     seq_index: torch.Tensor | None = None, failed_kind: str = "grad",
                     skipped: frozenset[str] = frozenset(), partial: frozenset[str] = frozenset(),
                     presync: Placement | None = None, replica: Replica | None = None,
                     declared: tuple[str, ...] = ()) -> Divergence:
    """`seq_index`: the global positions this rank's sequence pieces hold, for a permuted
    (load-balanced) layout; None for contiguous shards. `failed_kind`: the kind of the step's
    first failure (sp_harness.compare.tensor_check.KIND_ORDER); `skipped`: the modules the trace
    left out (they hold TP-sharded params: their outputs are pieces or partial sums);
    `partial`: the modules holding TP-sharded params below them at TP > 1, whose output or input
    grad, where it is the reference's whole tensor, may be a partial sum the framework reduces
    outside them (megatron's experts, whose reduce-scatter and all-gather are the token
    dispatcher's): not compared (a sequence slice is: a reduce-scatter's result is whole);
    `presync`: where the grads before the sync place a param-grad failure; `replica`: this rank's
    DP replica (DP > 1), whose rows of the reference its traced tensors are compared with;
    `declared`: the case's declared precision islands (Divergence.declared)."""
    found = _first_divergence(step=step, rank=rank, sharded=sharded, ref64=ref64, ref_lp=ref_lp, ref_alt=ref_alt,
                              dtype=dtype, seq_len=seq_len, seq_shards=seq_shards, tp_rank=tp_rank,
                              seq_index=seq_index, failed_kind=failed_kind, skipped=skipped, partial=partial,
                              presync=presync, replica=replica)
    return dataclasses.replace(found, declared=declared) if declared else found


def _first_divergence(*, step: int, rank: int, sharded: Recorder | Trace, ref64: Recorder | Trace,
                      ref_lp: Recorder | Trace, ref_alt: Recorder | Trace, dtype: torch.dtype, seq_len: int,
                      seq_shards, tp_rank: int, seq_index: torch.Tensor | None, failed_kind: str,
                      skipped: frozenset[str], partial: frozenset[str], presync: Placement | None,
                      replica: Replica | None) -> Divergence:
    if failed_kind == "grad" and presync is not None and presync.stage == "grad sync":
        # every rank's grads were right before the sync: an input grad that disagrees is a partial
        # sum the framework completes elsewhere, not where the error entered
        return Divergence(step=step, rank=rank, phase="sync", module=presync.param, ratio=0.0,
                          presync=presync.describe())
    # a failing input-grad check held the input grads to the reference's own scale
    free_scale = failed_kind not in FORWARD_KINDS and failed_kind != "input_grad"
    scale = 1.0
    unaligned: dict[str, list[tuple[str, str]]] = {"forward": [], "backward": []}
    unaligned_names: list[str] = []
    agreed: list[str] = []
    # a forward or loss failure entered in the forward: the input grads that diverge follow from it
    for phase in ("forward",) if failed_kind in FORWARD_KINDS else ("forward", "backward"):
        got_side = getattr(sharded, phase) if phase == "forward" else _with_missing_grads(sharded, ref64)
        compared: list[tuple[int, str, torch.Tensor, RefPieces, TensorCheck]] = []
        for order, (name, got) in enumerate(got_side.items()):
            want = getattr(ref64, phase).get(name)
            want_lp = getattr(ref_lp, phase).get(name)
            want_alt = getattr(ref_alt, phase).get(name)
            if want is None or want_lp is None:
                unaligned[phase].append((name, f"'{name}' (no module of that name in the reference)"))
                unaligned_names.append(name)
                continue
            if name in partial and got.shape == want.shape:
                unaligned[phase].append((name, f"'{name}' (TP-sharded params below it and its {phase} the reference's "
                                               f"whole tensor: may be a partial sum)"))
                unaligned_names.append(name)
                continue
            if phase == "backward" and replica is not None and replica.dp > 1 and _replica_rows(
                    got, want, replica) is None:
                unaligned[phase].append((name, f"'{name}' (input grad {tuple(got.shape)} has no replica's rows of "
                                               f"the reference's {tuple(want.shape)}: at DP {replica.dp} it is this "
                                               f"replica's share)"))
                unaligned_names.append(name)
                continue
            cut = _line_up(got, want, seq_len, seq_shards, tp_rank, seq_index, replica)
            if cut is None:
                unaligned[phase].append((name, f"'{name}' ({phase} {tuple(got.shape)} is neither the reference's "
                                               f"{tuple(want.shape)} nor this rank's sequence slice of it)"))
                unaligned_names.append(name)
                continue
            if phase == "backward" and replica is not None and replica.grad_scale != 1.0:
                scaled = cut
                cut = lambda t, scaled=scaled: scaled(t) * replica.grad_scale  # noqa: E731
            refs = RefPieces(r64=cut(want), lp=cut(want_lp), alt=None if want_alt is None else cut(want_alt))
            chk = check_tensor(kind=phase, name=name, step=step, rank=rank, got=got, refs=refs,
                               precision=precision_of(dtype))
            if phase == "backward":
                compared.append((order, name, got, refs, chk))  # judged below, at the backward's scale
                continue
            if not chk.ok:
                return _forward_divergence(step, rank, name, chk.ratio, order, sharded.order,
                                           skipped | set(unaligned_names), tuple(agreed))
            agreed.append(name)
        if phase == "backward":
            if free_scale:
                scale = backward_scale([(got, refs, chk) for _, _, got, refs, chk in compared], dtype)
            for order, name, got, refs, chk in compared:
                chk = _judge_at(scale, chk, got, refs, dtype)
                if not chk.ok:
                    said = presync.describe() if presync is not None and presync.stage == "backward" else ""
                    return Divergence(step=step, rank=rank, phase=phase, module=name, ratio=chk.ratio, order=order,
                                      presync=said, no_grad=name not in sharded.reached, input_grad_scale=scale)
    if failed_kind == "loss":  # KIND_ORDER judges the output first: it agreed
        return Divergence(step=step, rank=rank, phase="loss", module="", ratio=0.0)
    if failed_kind in FORWARD_KINDS or failed_kind == "input_grad":
        phase = "forward" if failed_kind in FORWARD_KINDS else "backward"
        candidates = unaligned[phase] + [(n, f"'{n}' (holds TP-sharded params: its {phase} is a piece or a "
                                             f"partial sum)") for n in sorted(skipped)]
        if phase == "forward":
            candidates = _after_last_agreeing(candidates, sharded.order, agreed)
        why = [reason for _, reason in candidates]
        if not why:
            note = (f"the model has no submodule to trace: the {failed_kind} failure enters inside the top-level "
                    f"module's own {phase}")
        else:
            more = f" and {len(why) - MAX_NAMED} more" if len(why) > MAX_NAMED else ""
            own = ", or in the top-level module's own forward" if phase == "forward" else ""
            note = (f"the {failed_kind} failure enters in a module that could not be compared: "
                    + "; ".join(why[:MAX_NAMED]) + more + own)
        return Divergence(step=step, rank=rank, phase="unaligned", module="", ratio=0.0, note=note)
    if presync is not None and presync.stage == "backward":
        return Divergence(step=step, rank=rank, phase="backward", module=presync.param.rpartition(".")[0],
                          param=presync.param, ratio=presync.ratio, order=len(sharded.backward),
                          presync=presync.describe(), input_grad_scale=scale)
    return Divergence(step=step, rank=rank, phase="none", module="", ratio=0.0,
                      presync=presync.describe() if presync is not None else "", input_grad_scale=scale)
