"""Stage: checks. The side-by-side check's rank job (sp_harness.checks.side_by_side drives it).

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

import torch
import torch.distributed as dist

from sp_harness.capture.comm import CommCounter
from sp_harness.capture.islands import IslandObserver
from sp_harness.capture.module_where import ModuleWhere
from sp_harness.capture.trace import Recorder
from sp_harness.checks.before_sync import BeforeSync
from sp_harness.checks.references import (
    KINDS,
    SAMPLES,
    Inline,
    LinearPiece,
    RefResult,
    Shared,
    make_references,
)
from sp_harness.checks.refproc import Remote, reference_process
from sp_harness.compare.divergence import Replica, first_divergence
from sp_harness.compare.tensor_check import TensorCheck, check_bounded
from sp_harness.compare.tolerance import FACTOR, RefPieces, check_tensor
from sp_harness.compare.update_scale import ScaleBound, scale_bound, update_scales
from sp_harness.compare.update_scale import sample as scale_sample
from sp_harness.config.case import as_batch
from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import RankResult, record
from sp_harness.launch import announce
from sp_harness.launch.failure import mark_module
from sp_harness.launch.wire import STEPS
from sp_harness.step.adversary import ReorderAdversary
from sp_harness.step.anchor import gather_full
from sp_harness.step.build import build, reference_copy
from sp_harness.step.context import reference_context
from sp_harness.step.inputs import batch_generator, batch_to, cut, global_loss, replica_slice, seq_index
from sp_harness.step.loop import ShardedLoop
from sp_harness.step.optim_ref import StepReference, float64_state, member_step, raw_state_of, reference_step
from sp_harness.step.params import (
    LocalParam,
    declared_grad,
    replica_drift,
    wrapper_prefix,
)
from sp_harness.step.precision import PRECISIONS, precision_of
from sp_harness.step.reference import RefStep


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
    lp = precision_of(dtype).reference
    out_err = (ref_lp.out.to(torch.float64) - ref64.out).abs() * (torch.finfo(dtype).eps / torch.finfo(lp).eps)
    out_err = torch.maximum(out_err, (ref_alt.out - ref64.out).abs())
    return FACTOR * float((ref64.out_grad * out_err).norm())


class _SideBySide:
    """One check on one rank: the sharded model stepped beside its three references."""

    def __init__(self, config: CheckConfig, *, inline_references: bool = False):
        """`inline_references`: compute the references in this process (the profiler times their
        parts) instead of the rank's reference process (sp_harness.checks.refproc)."""
        self.config = config
        self.dtype = config.torch_dtype
        self.precision = precision_of(self.dtype)
        if not inline_references:
            reference_process()  # a first job's reference process imports torch while this rank builds
        # a throwaway counter around the sharded factory: its collectives are announced (desync
        # detection) but not counted, so the per-step rows stay what the model does per step
        self.built = build(config, around_shard=CommCounter())
        announce.phase("preparing the check")
        self.ctx, self.case, self.sharded = self.built.ctx, self.built.case, self.built.sharded
        self.params = self.built.params
        self.adversary = _adversary(config)
        self.ref64 = {n: p.detach().clone() for n, p in self.built.reference.named_parameters()}
        """The reference's params before step 0 (what the sharded factory must start from)."""
        self.inline = make_references(self.built.reference, self._reference_copy, config,
                                      self.built.device) if inline_references else None
        computes = (Inline(self.inline, self.case) if self.inline is not None
                    else Remote(config, self.built.reference, self.built.device))
        self.refs = Shared(computes, self.built.device, self.dtype, self._linear_pieces())
        self.result = RankResult(rank=self.ctx.rank, findings=[p.spec.finding for p in self.params if p.spec.finding])
        self.counter = CommCounter(self.ctx.group_label)
        self.loop = ShardedLoop(self.built, phase=self._phase)
        self.opt = self.loop.opt
        self.full: dict[str, torch.Tensor] = {}
        # modules holding a TP-sharded param return pieces or partial sums: not comparable
        local_pieces = frozenset(p.local_name.rpartition(".")[0] for p in self.params if not p.replicated_tp)
        prefix = wrapper_prefix(self.params)
        # ... unless the case says the framework completes one's output inside it
        whole = frozenset(self.sharded.whole_outputs)
        if unknown := whole - {n for n, _ in self.sharded.module.named_modules()}:
            raise ValueError(f"Sharded.whole_outputs names no module of the sharded model: {sorted(unknown)}")
        self.pieces = frozenset(n[len(prefix):] for n in local_pieces - whole)
        self.recorder = Recorder(self.sharded.module, local_pieces, prefix, outputs_only=whole)
        self.prefix = prefix
        self.before_sync = BeforeSync(self.built, self.ref64, local_pieces, prefix)
        self.compute_s = 0.0

    def _phase(self, name: str) -> None:
        self.counter.phase = name

    def _reference_copy(self) -> torch.nn.Module:
        built = self.built
        return reference_copy(built.case, built.config, reference_context(built.config, built.device),
                              built.reference, torch.float64, built.device)

    def judge(self, kind, name, step, got, want64, want_lp, offset=(), want_alt=None, extra=0.0, dof=0, samples=(),
              grad_noise=None):
        refs = RefPieces(r64=want64, lp=want_lp, alt=want_alt, members=tuple(samples))
        record(self.result, check_tensor(kind=kind, name=name, step=step, rank=self.ctx.rank, got=got, refs=refs,
                                         precision=self.precision, offset=offset, extra_allowed=extra, dof=dof,
                                         grad_noise=grad_noise, summed_over=self.built.config.world_size))

    def check_init(self) -> None:
        """The sharded factory must start from the reference's weights, cast to the run dtype."""
        for p in self.params:
            w64 = self.ref64[p.spec.ref_name]
            got, want, _, off = p.full_or_piece(p.param.detach(), w64, w64, self.ctx)
            record(self.result, check_bounded(kind="init", name=p.spec.ref_name, step=0, rank=self.ctx.rank,
                                              got=got, want=want.to(self.dtype), bound=torch.zeros_like(want),
                                              offset=off))

    def start_references(self, batch) -> None:
        """Anchor the references at the sharded run's params (a collective) and set them going."""
        shapes = {n: t.shape for n, t in self.ref64.items()}
        self.full = gather_full(self.params, shapes, self.ctx)
        self.refs.start(self.full, batch)

    def finish_references(self) -> dict[str, RefResult]:
        return self.refs.finish()

    def sharded_pass(self, batch, step: int = 0):
        local = self.loop.local_batch(batch)
        # islands are static: step 0 names them, later steps pay nothing
        observer = IslandObserver(self.sharded.module, self.dtype) if step == 0 else None
        t0 = time.perf_counter()
        # where a crash or a collective happened in the model (failure.mark_module, Collective.module)
        where = ModuleWhere(self.sharded.module, lambda: self.counter.phase, self.prefix)
        announce.track_module(where.now)
        try:
            with where:
                try:
                    with self.counter, self.adversary:
                        with observer if observer is not None else contextlib.nullcontext():
                            out, loss = self.loop.forward_backward(local, batch.target,
                                                                   forward_only=self.forward_only)
                        if observer is not None:
                            self.result.islands = observer.islands
                        if not self.forward_only:
                            self.before_sync.keep()
                            self.loop.sync_grads()
                except BaseException as exc:
                    mark_module(exc, where.now())  # before the stack closes
                    raise
        finally:
            announce.track_module(None)
        self.compute_s += time.perf_counter() - t0
        return local, out, loss

    def judge_outputs(self, step, batch, local, out, loss, refs: dict[str, RefResult]) -> None:
        """Forward output, loss and input grads against the references' matching pieces."""
        r64, r_lp, r_alt = (refs[w].step for w in KINDS)
        ctx, layout = self.ctx, self.sharded.output_layout
        want64, out_offset = cut(r64.out, layout, ctx)
        local_tokens = self.case.tokens(local.target)
        samples = [refs[w].step for w in SAMPLES if w in refs]
        self.judge("forward", "output", step, out, want64, cut(r_lp.out, layout, ctx)[0], out_offset,
                   cut(r_alt.out, layout, ctx)[0], dof=local_tokens,
                   samples=[cut(r.out, layout, ctx)[0] for r in samples])
        total = global_loss(loss, self.sharded, ctx)
        self.judge("loss", "loss", step, total, r64.loss, r_lp.loss, (), r_alt.loss,
                   extra=_loss_allowance(r64, r_lp, r_alt, self.dtype))
        self.result.losses.append(float(total))
        # DDP's convention: each replica's loss is the mean over its own micro-batch, so its
        # input grad is the global-mean reference's times (global tokens / replica tokens)
        tgt = batch.target
        scale = self.case.tokens(tgt) / self.case.tokens(replica_slice(tgt, layout, ctx)) if ctx.dp > 1 else 1.0
        for name, grad64 in r64.input_grads.items():  # none in a forward-only check
            in_layout = self.sharded.input_layouts.get(name, self.sharded.input_layout)
            want64, in_off = cut(grad64 * scale, in_layout, ctx)
            want_lp, _ = cut(r_lp.input_grads[name] * scale, in_layout, ctx)
            want_alt, _ = cut(r_alt.input_grads[name] * scale, in_layout, ctx)
            label = "input" if batch.positional else f"input:{name}"
            self.judge("input_grad", label, step, local.inputs[name].grad, want64, want_lp, in_off, want_alt,
                       dof=local_tokens, samples=[cut(r.input_grads[name] * scale, in_layout, ctx)[0] for r in samples])

    def judge_lse(self, step: int, refs: dict[str, RefResult]) -> None:
        """Attention log-sum-exps, where the sharded model exposes them. A module exposes its own
        by setting, in each forward, `lse` (B, h, s) (the log-sum-exp of each of its query rows'
        scores) and `lse_index = (heads, positions)`: the global query heads and sequence
        positions of those rows, for the reference module of the same name. An LSE is what a
        ring or hybrid merges partial attentions by, so a wrong one can hide behind a right
        output (pytorch/pytorch#181645: an LSE returned in base 2)."""
        r64 = refs["r64"].step
        for name, module in self.sharded.module.named_modules():
            index = getattr(module, "lse_index", None)
            if index is None:
                continue
            if name not in r64.lse:
                why = (f"lse of '{name}': the reference has no attention module of that name "
                       f"exposing an LSE (it has: {', '.join(sorted(r64.lse)) or 'none'}); name the sharded module "
                       f"as the reference's to have its LSE checked")
                if why not in self.result.not_run:
                    self.result.not_run.append(why)
                continue
            heads, positions = index
            got = module.lse
            rows = slice(self.ctx.dp_rank * got.shape[0], (self.ctx.dp_rank + 1) * got.shape[0])
            want64, want_lp, want_alt = (_lse_piece(refs[w].step.lse[name], rows, heads, positions) for w in KINDS)
            samples = [_lse_piece(refs[w].step.lse[name], rows, heads, positions) for w in SAMPLES if w in refs]
            self.judge("lse", f"{name}.lse", step, got, want64, want_lp,
                       want_alt=want_alt, dof=len(positions), samples=samples)

    @property
    def forward_only(self) -> bool:
        return bool(self.built.config.forward_only)

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The grad the implementation left for `param`, as the grad check reads it."""
        return declared_grad(param, self.sharded.grad_attr)

    def judge_grads(self, step: int, tokens: int, refs: dict[str, RefResult]) -> None:
        if self.forward_only:
            return
        grads = {w: refs[w].grads for w in refs}
        for p in self.params:
            ref = p.spec.ref_name
            got_grad = self.grad_of(p.param)
            g64, glp = grads["r64"][ref], grads["lp"][ref]
            assert g64 is not None and glp is not None, f"the references computed no grad of {ref} (backward ran)"
            got, w64, wlp, off = p.full_or_piece(got_grad, g64, glp, self.ctx)
            self.judge("grad", ref, step, got, w64, wlp, off, p.piece_of(grads["alt"][ref], self.ctx), dof=tokens,
                       samples=[p.piece_of(grads[w][ref], self.ctx) for w in SAMPLES if w in grads],
                       grad_noise=refs["r64"].grad_noise.get((self.ctx.rank, ref)))

    def _linear_pieces(self) -> tuple[LinearPiece, ...]:
        """Every rank's pieces of the weight (2-D) and bias (1-D) params that are a block of the
        reference's rows x columns, for the float64 reference to derive their grads' degrees of
        freedom (runs with an ensemble only: nothing else reads them). A collective."""
        if not self.precision.members or self.forward_only:
            return ()
        mine = []
        for p in self.params:
            ref = self.ref64[p.spec.ref_name]
            if (p.spec.ref_name.rpartition(".")[2], ref.dim()) not in (("weight", 2), ("weight", 1), ("bias", 1)):
                continue
            grid = p.piece_of(torch.arange(ref.shape[0]).view(-1, *([1] * (ref.dim() - 1))).expand(ref.shape), self.ctx)
            rows, cols = grid.unique(), None
            if ref.dim() == 2:
                col_grid = p.piece_of(torch.arange(ref.shape[1]).view(1, -1).expand(ref.shape), self.ctx)
                cols = col_grid.unique()
                if len(rows) * len(cols) != col_grid.numel():
                    continue  # not a block: the grad keeps a share of its tokens
            mine.append(LinearPiece(rank=self.ctx.rank, name=p.spec.ref_name, rows=rows, cols=cols))
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return tuple(mine)
        every: list[list[LinearPiece] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return tuple(piece for pieces in every for piece in pieces or ())

    def localize(self, step: int, batch, failed_kind: str, presync=None) -> None:
        """At the first failing step, the first module whose output or input grad diverged."""
        assert self.config.seq_len is not None, "the check resolves seq_len"
        # the references keep every module: a TP-sharded module's DTensor output is compared
        traces = self.refs.traces(self.full, batch, frozenset())
        ctx, layout = self.ctx, self.sharded.output_layout
        tgt = batch.target
        # the input-grad check's scale: each replica's loss is the mean over its own micro-batch
        scale = self.case.tokens(tgt) / self.case.tokens(replica_slice(tgt, layout, ctx)) if ctx.dp > 1 else 1.0
        self.result.divergence = first_divergence(
            step=step, rank=self.ctx.rank, sharded=self.recorder, ref64=traces["r64"], ref_lp=traces["lp"],
            ref_alt=traces["alt"], dtype=self.dtype, seq_len=self.config.seq_len, seq_shards=self.ctx.seq_shards,
            tp_rank=self.ctx.tp_rank, failed_kind=failed_kind, skipped=self.pieces,
            partial=self.before_sync.partial, presync=presync,
            replica=Replica(dp=ctx.dp, dp_rank=ctx.dp_rank, batch_dim=layout.batch_dim, grad_scale=scale),
            seq_index=seq_index(self.sharded.output_layout, self.config.seq_len, self.ctx.seq_shards,
                                self.ctx.tp_rank), declared=tuple(self.case.precision_islands))

    def optimizer_stage(self, step: int) -> None:
        """The update, judged on the sharded run's own params, grads and state. The optimizer steps
        on the declared grads (`Sharded.grad_attr`), copied into `.grad`. Forward only: no step."""
        if self.forward_only:
            self.result.comm.append(self.counter.snapshot())
            self.counter.stats.clear()
            return
        self.loop.load_grads()
        expected = [_expected_step(p, self.opt, self.config, self.dtype) for p in self.params]
        t0 = time.perf_counter()
        with self.counter:
            self.loop.optimizer_step()
        self.compute_s += time.perf_counter() - t0
        self.loop.clear_grads()
        self.judge_update(step, expected)

    def judge_update(self, step: int, expected: list[StepReference]) -> None:
        """After the optimizer step: the step's collectives filed, each param against its expected
        update, and the replicated params' drift across ranks."""
        self.result.comm.append(self.counter.snapshot())
        self.counter.stats.clear()
        for p, ref in zip(self.params, expected, strict=True):
            got = p.full(p.param.detach())
            record(self.result, check_bounded(kind="param", name=p.spec.ref_name, step=step, rank=self.ctx.rank,
                                              got=got, want=ref.param, bound=ref.bound,
                                              offset=p.offset(self.ref64[p.spec.ref_name], self.ctx),
                                              scale=_update_scale(ref, got)))
        self.result.drift.extend(replica_drift(step, self.params, self.ctx, set(self.case.replicated_hint)))

    def step(self, step: int, gen: torch.Generator) -> None:
        batch = as_batch(self.case.make_batch(self.config, step, gen))
        batch = batch_to(batch, self.built.device)
        self.recorder.clear()
        failures_before = len(self.result.failures)
        # the references compute (in their own process) while the sharded model steps
        self.start_references(batch)
        local, out, loss = self.sharded_pass(batch, step)
        refs = self.finish_references()
        self.judge_outputs(step, batch, local, out, loss, refs)
        self.judge_lse(step, refs)
        self.judge_grads(step, self.case.tokens(batch.target), refs)
        fails = not failures_before and len(self.result.failures) > failures_before
        first = min(self.result.failures, key=TensorCheck.sort_key) if fails else None
        presync = None
        if not self.forward_only:  # every rank, every step: a collective
            failing = [f.name for f in sorted(self.result.failures, key=TensorCheck.sort_key) if f.kind == "grad"]
            presync = self.before_sync.place(step, refs, failing if first is not None and first.kind == "grad" else None,
                                             self.recorder.order)
        if first is not None:
            self.localize(step, batch, first.kind, presync)
        self.optimizer_stage(step)


def run_rank(config: CheckConfig) -> RankResult:
    """The job: one side-by-side run of `config` on this rank."""
    return drive(_SideBySide, config)


def drive(kind: type[_SideBySide], config: CheckConfig) -> RankResult:
    """Build `kind` for `config`, check its init, run its steps with progress, and time it: the
    body of every rank job built on `_SideBySide`."""
    t_start = time.perf_counter()
    run = kind(config)
    run.result.timings["setup_s"] = time.perf_counter() - t_start
    run.check_init()
    gen = batch_generator(config.seed)
    assert config.steps is not None, "the check resolves steps"
    announce.phase(STEPS)
    for step in range(config.steps):
        run.step(step, gen)
        announce.progress("step", step + 1, config.steps)
    run.recorder.remove()
    run.result.timings["compute_s"] = run.compute_s
    run.result.timings["total_s"] = time.perf_counter() - t_start
    return run.result


def _adversary(config: CheckConfig):
    """The mode the sharded side runs under: under `--adversary` its reductions are reordered
    (and TF32 applies, a platform setting the references share); see sp_harness.step.adversary."""
    if config.adversary == "off":
        return contextlib.nullcontext()
    return ReorderAdversary(config.seed, reorder=True, tf32=config.adversary == "reorder-tf32",
                            walk=precision_of(config.torch_dtype).walk)


def _expected_step(p: LocalParam, opt: torch.optim.Optimizer, config: CheckConfig,
                   dtype: torch.dtype) -> StepReference:
    """This param after the coming optimizer step, in float64 from its own values, and the bound;
    below float32 also the unfused member's step (sp_harness.compare.update_scale)."""
    to_full = (lambda t: t.full_tensor()) if p.dtensor else (lambda t: t)
    value = to_full(p.param.detach())
    grad = p.gathered(p.param.grad)  # a gather every rank runs, with or without its grad
    assert config.optimizer is not None and config.lr is not None, "the check resolves optimizer and lr"
    raw = raw_state_of(opt, p.param, to_full)  # a DTensor's state gathered once, for both
    ref = reference_step(optimizer=config.optimizer, lr=config.lr, param=value, grad=grad,
                         state=float64_state(raw), dtype=dtype)
    judged = PRECISIONS.get(value.dtype)
    if grad is not None and judged is not None and judged.update_scale:
        ref.before = scale_sample(value).to(torch.float64)
        ref.member = member_step(optimizer=config.optimizer, lr=config.lr, param=scale_sample(value),
                                 grad=scale_sample(grad),
                                 raw_state={k: scale_sample(v) if isinstance(v, torch.Tensor) and v.dim() else v
                                            for k, v in raw.items()})
    return ref


def _update_scale(ref: StepReference, got: torch.Tensor) -> ScaleBound | None:
    """The run's coherent update scale against the member's, where the param has one (on the
    elements `scale_sample` picks, as the member was stepped)."""
    if ref.member is None or ref.before is None:
        return None
    run, member = update_scales(before=ref.before, exact=scale_sample(ref.param), gots=[scale_sample(got), ref.member],
                                dtype=got.dtype)
    return scale_bound(run, member, ref.scale_slack)
