"""Stage: build reference + sharded -> step -> capture -> compare (runs on every rank).

`run_rank(config)` is the job the pool runs. Every rank builds the float64 reference and a
same-precision reference (deterministic CPU code: identical on every rank), hands a copy of the
reference in the run dtype to the case's sharded factory (so sharded weights come from the
reference's state dict), then for K steps: forward on the rank's piece of the global batch,
loss, backward, the case's grad sync, optimizer step. Each rank judges its own pieces (outputs,
input grads, param grads, params after the update) against the matching slices of the
reference, so every mismatch names its rank. Parameters that must stay replicated are compared
bit for bit across the ranks that hold them. Collectives of the sharded model are counted per
phase (and, with the case's sharded factory, announced to the driver for desync detection); the
engine's own bookkeeping collectives run outside the counter.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from sp_harness.capture.comm import CommCounter
from sp_harness.capture.islands import Island, IslandObserver
from sp_harness.capture.trace import Recorder
from sp_harness.checks.references import KINDS, make_references
from sp_harness.compare.divergence import Divergence, first_divergence
from sp_harness.compare.tolerance import FACTOR, TensorCheck, check_bounded, check_tensor, lp_dtype
from sp_harness.config.case import RankContext, as_batch
from sp_harness.config.check_config import CheckConfig
from sp_harness.launch import announce
from sp_harness.step.adversary import ReorderAdversary
from sp_harness.step.anchor import gather_full
from sp_harness.step.build import build
from sp_harness.step.inputs import cut, forward_loss, global_loss, rank_batch, replica_slice, seq_index
from sp_harness.step.optim_ref import make_optimizer, reference_step, state_of
from sp_harness.step.params import Drift, LocalParam, replica_drift
from sp_harness.step.reference import RefStep

MAX_FAILURES_KEPT = 64


@dataclass(kw_only=True)
class RankResult:
    rank: int
    failures: list[TensorCheck] = field(default_factory=list)
    worst: dict[str, TensorCheck] = field(default_factory=dict)
    """Largest ratio per kind, passing or not."""
    drift: list[Drift] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    comm: list[list[dict]] = field(default_factory=list)
    """Per step, the collective counter's rows."""
    num_checks: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    divergence: Divergence | None = None
    """At the first failing step: the first module whose output or input grad left its bound."""
    islands: list[Island] = field(default_factory=list)
    """Ops of the sharded forward and backward at step 0 that computed below the run dtype."""


def _lse_piece(full: torch.Tensor, rows: slice, heads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A reference's (B, a, S) log-sum-exps at one rank's rows: its DP replica's sequences, the
    query heads and the positions the rank's module says it holds."""
    full = full[rows]
    return full.index_select(1, heads.to(full.device)).index_select(2, positions.to(full.device))


def _loss_allowance(ref64: RefStep, ref_lp: RefStep, ref_alt: RefStep, dtype: torch.dtype) -> float:
    """The loss's error propagated from its output's, to first order dL = <dL/dout, d out>: for
    rounding errors independent across elements that sum has a spread of ||dL/dout * d out||_2,
    taken with the references' per-element output errors. FACTOR of that spread, as for any
    tensor's max-abs bound. A scalar has no norm to concentrate: one sample of the reference's own
    loss error can be small by luck (a float32 loss under TF32 came within 0.91x of its bound)."""
    if ref64.out_grad is None or not ref64.out.is_floating_point():
        return 0.0
    lp = lp_dtype(dtype)
    out_err = (ref_lp.out.to(torch.float64) - ref64.out).abs() * (torch.finfo(dtype).eps / torch.finfo(lp).eps)
    out_err = torch.maximum(out_err, (ref_alt.out - ref64.out).abs())
    return FACTOR * float((ref64.out_grad * out_err).norm())


class _SideBySide:
    """One check on one rank: the sharded model stepped beside its three references."""

    def __init__(self, config: CheckConfig):
        self.config = config
        self.dtype = config.torch_dtype
        # a throwaway counter around the sharded factory: its collectives are announced (desync
        # detection) but not counted, so the per-step rows stay what the model does per step
        self.built = build(config, around_shard=CommCounter())
        self.ctx, self.case, self.sharded = self.built.ctx, self.built.case, self.built.sharded
        self.params = self.built.params
        self.adversary, platform = _adversaries(config, self.ctx)
        self.refs = make_references(self.built, config, platform, matmul_input_precision(config, self.built.device))
        self.ref = {w: self.refs.params(w) for w in KINDS}
        self.result = RankResult(rank=self.ctx.rank)
        self.opt = make_optimizer(config.optimizer, config.lr, self.sharded.module.parameters())
        self.counter = CommCounter(self.ctx.group_label)
        self.full: dict[str, torch.Tensor] = {}
        traced = not any(p.dtensor for p in self.params)  # DTensor outputs do not line up with plain ones
        # modules holding a TP-sharded param return pieces or partial sums: not comparable
        pieces = frozenset(p.local_name.rpartition(".")[0] for p in self.params if not p.replicated_tp)
        models = (self.sharded.module, self.refs.r64, self.refs.lp, self.refs.alt)
        self.recorders = [Recorder(m, pieces) for m in models] if traced else []
        self.compute_s = 0.0

    def judge(self, kind, name, step, got, want64, want_lp, offset=(), want_alt=None, extra=0.0, dof=0):
        record(self.result, check_tensor(kind=kind, name=name, step=step, rank=self.ctx.rank, got=got, ref64=want64,
                                         ref_lp=want_lp, dtype=self.dtype, offset=offset, ref_alt=want_alt,
                                         extra_allowed=extra, dof=dof))

    def check_init(self) -> None:
        """The sharded factory must start from the reference's weights, cast to the run dtype."""
        for p in self.params:
            w64 = self.ref["r64"][p.spec.ref_name].detach()
            got, want, _, off = p.full_or_piece(p.param.detach(), w64, w64, self.ctx)
            record(self.result, check_bounded(kind="init", name=p.spec.ref_name, step=0, rank=self.ctx.rank,
                                              got=got, want=want.to(self.dtype), bound=torch.zeros_like(want),
                                              offset=off))

    def reference_passes(self, batch) -> tuple[RefStep, RefStep, RefStep]:
        shapes = {n: t.shape for n, t in self.ref["r64"].items()}
        self.full = gather_full(self.params, shapes, self.ctx)
        steps = self.refs.passes(self.full, self.case, batch)
        return steps["r64"], steps["lp"], steps["alt"]

    def sharded_pass(self, batch, step: int = 0):
        local = rank_batch(batch, self.sharded, self.ctx, self.dtype)
        # islands are static: step 0 names them, later steps pay nothing
        observer = IslandObserver(self.sharded.module, self.dtype) if step == 0 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with self.counter, self.adversary:
            self.counter.phase = "forward"
            with observer:
                out, loss = forward_loss(self.case, self.sharded, local, batch.target, self.ctx)
                self.counter.phase = "backward"
                loss.backward()
            if step == 0:
                self.result.islands = observer.islands
            self.counter.phase = "grad_sync"
            self.sharded.sync_grads()
        self.compute_s += time.perf_counter() - t0
        return local, out, loss

    def judge_outputs(self, step, batch, local, out, loss, refs: tuple[RefStep, RefStep, RefStep]) -> None:
        """Forward output, loss and input grads against the references' matching pieces."""
        r64, r_lp, r_alt = refs
        ctx, layout = self.ctx, self.sharded.output_layout
        want64, out_offset = cut(r64.out, layout, ctx)
        local_tokens = self.case.tokens(local.target)
        self.judge("forward", "output", step, out, want64, cut(r_lp.out, layout, ctx)[0], out_offset,
                   cut(r_alt.out, layout, ctx)[0], dof=local_tokens)
        total = global_loss(loss, self.sharded, ctx)
        self.judge("loss", "loss", step, total, r64.loss, r_lp.loss, (), r_alt.loss,
                   extra=_loss_allowance(r64, r_lp, r_alt, self.dtype))
        self.result.losses.append(float(total))
        # DDP's convention: each replica's loss is the mean over its own micro-batch, so its
        # input grad is the global-mean reference's times (global tokens / replica tokens)
        tgt = batch.target
        scale = self.case.tokens(tgt) / self.case.tokens(replica_slice(tgt, layout, ctx)) if ctx.dp > 1 else 1.0
        for name, grad64 in r64.input_grads.items():
            in_layout = self.sharded.input_layouts.get(name, self.sharded.input_layout)
            want64, in_off = cut(grad64 * scale, in_layout, ctx)
            want_lp, _ = cut(r_lp.input_grads[name] * scale, in_layout, ctx)
            want_alt, _ = cut(r_alt.input_grads[name] * scale, in_layout, ctx)
            label = "input" if batch.positional else f"input:{name}"
            self.judge("input_grad", label, step, local.inputs[name].grad, want64, want_lp, in_off, want_alt,
                       dof=local_tokens)

    def judge_lse(self, step: int, refs: tuple[RefStep, RefStep, RefStep]) -> None:
        """Attention log-sum-exps, where the sharded model exposes them. A module exposes its own
        by setting, in each forward, `lse` (B, h, s) (the log-sum-exp of each of its query rows'
        scores) and `lse_index = (heads, positions)`: the global query heads and sequence
        positions of those rows, for the reference module of the same name. An LSE is what a
        ring or hybrid merges partial attentions by, so a wrong one can hide behind a right
        output (pytorch/pytorch#181645: an LSE returned in base 2)."""
        r64 = refs[0]
        for name, module in self.sharded.module.named_modules():
            index = getattr(module, "lse_index", None)
            if index is None or name not in r64.lse:
                continue
            heads, positions = index
            got = module.lse
            rows = slice(self.ctx.dp_rank * got.shape[0], (self.ctx.dp_rank + 1) * got.shape[0])
            want64, want_lp, want_alt = (_lse_piece(r.lse[name], rows, heads, positions) for r in refs)
            self.judge("lse", f"{name}.lse", step, got, want64, want_lp,
                       want_alt=want_alt, dof=len(positions))

    def judge_grads(self, step: int, tokens: int) -> None:
        for p in self.params:
            ref = p.spec.ref_name
            got, w64, wlp, off = p.full_or_piece(p.param.grad, self.ref["r64"][ref].grad, self.ref["lp"][ref].grad,
                                                 self.ctx)
            self.judge("grad", ref, step, got, w64, wlp, off, p.piece_of(self.ref["alt"][ref].grad, self.ctx),
                       dof=tokens)

    def localize(self, step: int, batch) -> None:
        """At the first failing step, the first module whose output or input grad diverged."""
        self.refs.recompute_missing(self.full, self.case, batch)
        rec = self.recorders
        self.result.divergence = first_divergence(
            step=step, rank=self.ctx.rank, sharded=rec[0], ref64=rec[1], ref_lp=rec[2], ref_alt=rec[3],
            dtype=self.dtype, seq_len=self.config.seq_len, seq_shards=self.ctx.seq_shards, tp_rank=self.ctx.tp_rank,
            seq_index=seq_index(self.sharded.output_layout, self.config.seq_len, self.ctx.seq_shards,
                                self.ctx.tp_rank))

    def optimizer_stage(self, step: int) -> None:
        """The update, judged on the sharded run's own params, grads and state."""
        expected = [_expected_step(p, self.opt, self.config, self.dtype) for p in self.params]
        t0 = time.perf_counter()
        with self.counter:
            self.counter.phase = "optimizer"
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.compute_s += time.perf_counter() - t0
        for m in (self.refs.r64, self.refs.lp, self.refs.alt):
            m.zero_grad(set_to_none=True)
        self.result.comm.append(self.counter.snapshot())
        self.counter.stats.clear()
        for p, (want, bound) in zip(self.params, expected, strict=True):
            record(self.result, check_bounded(kind="param", name=p.spec.ref_name, step=step, rank=self.ctx.rank,
                                              got=p.full(p.param.detach()), want=want, bound=bound,
                                              offset=p.offset(self.ref["r64"][p.spec.ref_name], self.ctx)))
        self.result.drift.extend(replica_drift(step, self.params, self.ctx, set(self.case.replicated_hint)))

    def step(self, step: int, gen: torch.Generator) -> None:
        batch = as_batch(self.case.make_batch(self.config, step, gen))
        batch = type(batch)(inputs={k: v.to(self.built.device) for k, v in batch.inputs.items()},
                            target=batch.target.to(self.built.device), positional=batch.positional)
        for r in self.recorders:
            r.clear()
        failures_before = len(self.result.failures)
        refs = self.reference_passes(batch)
        local, out, loss = self.sharded_pass(batch, step)
        self.judge_outputs(step, batch, local, out, loss, refs)
        self.judge_lse(step, refs)
        self.judge_grads(step, self.case.tokens(batch.target))
        if self.recorders and not failures_before and len(self.result.failures) > failures_before:
            self.localize(step, batch)
        self.optimizer_stage(step)


def run_rank(config: CheckConfig) -> RankResult:
    """The job: one side-by-side run of `config` on this rank."""
    t_start = time.perf_counter()
    run = _SideBySide(config)
    run.result.timings["setup_s"] = time.perf_counter() - t_start
    run.check_init()
    gen = torch.Generator().manual_seed(config.seed + 7919)
    for step in range(config.steps):
        run.step(step, gen)
        announce.progress("step", step + 1, config.steps)
    for r in run.recorders:
        r.remove()
    run.result.timings["compute_s"] = run.compute_s
    run.result.timings["total_s"] = time.perf_counter() - t_start
    return run.result


def matmul_input_precision(config: CheckConfig, device: torch.device) -> float | None:
    """Relative precision float32 matmul inputs are rounded to on this platform, if coarser than
    float32: TF32 (2**-10) under `--adversary reorder-tf32`, or on a GPU whose
    `torch.get_float32_matmul_precision()` is 'high' (TF32) or 'medium' (bfloat16, 2**-7)."""
    if config.torch_dtype != torch.float32:
        return None
    if config.adversary == "reorder-tf32":
        return 2.0 ** -10
    if device.type == "cuda":
        return {"high": 2.0 ** -10, "medium": 2.0 ** -7}.get(torch.get_float32_matmul_precision())
    return None


def _adversaries(config: CheckConfig, ctx: RankContext):
    """(mode for the sharded side, mode for the same-precision reference).

    The same-precision reference always runs its matmuls with a random worst-order summation
    error (sp_harness.step.adversary.order_error at its accumulator's precision): its error is then what
    the least accurate legal kernel would make, not what this CPU's happens to. Under
    `--adversary` the sharded side is reordered (and TF32 applies to both sides, a platform
    setting); see sp_harness.step.adversary."""
    tf32 = config.adversary == "reorder-tf32"
    platform = ReorderAdversary(config.seed + 1, reorder=False, order_noise=True, tf32=tf32)
    if config.adversary == "off":
        return contextlib.nullcontext(), platform
    return ReorderAdversary(config.seed, reorder=True, tf32=tf32), platform


def record(result: RankResult, chk: TensorCheck) -> None:
    result.num_checks += 1
    best = result.worst.get(chk.kind)
    if best is None or chk.ratio > best.ratio:
        result.worst[chk.kind] = chk
    if not chk.ok and len(result.failures) < MAX_FAILURES_KEPT:
        result.failures.append(chk)


def _expected_step(p: LocalParam, opt: torch.optim.Optimizer, config: CheckConfig,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This param after the coming optimizer step, in float64 from its own values, and the bound."""
    to_full = (lambda t: t.full_tensor()) if p.dtensor else (lambda t: t)
    value = to_full(p.param.detach())
    grad = None if p.param.grad is None else to_full(p.param.grad)
    ref = reference_step(optimizer=config.optimizer, lr=config.lr, param=value, grad=grad,
                         state=state_of(opt, p.param, to_full), dtype=dtype)
    return ref.param, ref.bound
