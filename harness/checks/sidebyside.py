"""Stage: build reference + sharded -> step -> capture -> compare (runs on every rank).

`run_rank(config)` is the job the pool runs. Every rank builds the float64 reference and a
same-precision reference (deterministic CPU code: identical on every rank), hands a copy of the
reference in the run dtype to the case's sharded factory (so sharded weights come from the
reference's state dict), then for K steps: forward on the rank's piece of the global batch,
loss, backward, the case's grad sync, optimizer step. Each rank judges its own pieces (outputs,
input grads, param grads, params after the update) against the matching slices of the
reference, so every mismatch names its rank. Parameters that must stay replicated are compared
bit for bit across the ranks that hold them. Collectives of the sharded model are counted per
phase; the engine's own bookkeeping collectives run outside the counter.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness.capture.comm import CommCounter
from sp_harness.capture.trace import Divergence, Recorder, first_divergence
from sp_harness.compare.tolerance import FACTOR, TensorCheck, check_bounded, check_tensor, lp_dtype
from sp_harness.config import shards as sh
from sp_harness.config.case import Case, Layout, ParamSpec, RankContext, Sharded, get_case
from sp_harness.config.check_config import CheckConfig
from sp_harness.step.adversary import ReorderAdversary
from sp_harness.step.anchor import gather_full
from sp_harness.step.optim_ref import make_optimizer, reference_step, state_of
from sp_harness.step.rounding import RoundingNoise, perturb_

MAX_FAILURES_KEPT = 64


@dataclass(kw_only=True)
class Drift:
    step: int
    name: str
    """Reference name of the parameter that should be replicated."""
    group: str
    """'tp' or 'dp': across which ranks it differs."""
    max_abs: float
    ranks: tuple[int, ...]

    def describe(self) -> str:
        return (f"step {self.step} replica drift of {self.name} across {self.group} ranks "
                f"{list(self.ranks)}: max |diff| {self.max_abs:.3g} (must be 0, bit-identical)")


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


_GROUPS: dict[tuple[int, int], Any] = {}


def _groups(world_size: int, dp: int):
    """TP and DP groups of a dp x tp mesh, created once per pool (new_group is collective)."""
    key = (world_size, dp)
    if key not in _GROUPS:
        tp = world_size // dp
        rank = dist.get_rank()
        mine = {}
        for d in range(dp):
            ranks = tuple(range(d * tp, (d + 1) * tp))
            g = dist.new_group(list(ranks)) if tp < world_size else dist.group.WORLD
            if rank in ranks:
                mine["tp"] = (g, ranks)
        for t in range(tp):
            ranks = tuple(range(t, world_size, tp))
            g = dist.new_group(list(ranks)) if dp < world_size else dist.group.WORLD
            if rank in ranks:
                mine["dp"] = (g, ranks)
        _GROUPS[key] = mine
    return _GROUPS[key]


_MESHES: dict[tuple[int, int, str], Any] = {}


def make_context(config: CheckConfig, device: torch.device) -> RankContext:
    world_size = dist.get_world_size()
    if world_size != config.world_size:
        raise RuntimeError(f"job for world_size {config.world_size} sent to a world of {world_size}")
    groups = _groups(world_size, config.dp)
    rank = dist.get_rank()
    tp = config.tp
    seq_shards = config.seq_shards or sh.chunk_sizes(config.seq_len or 0, tp)
    ctx = RankContext(config=config, rank=rank, world_size=world_size, dp_rank=rank // tp, tp_rank=rank % tp,
                      tp_group=groups["tp"][0], dp_group=groups["dp"][0], tp_ranks=groups["tp"][1],
                      dp_ranks=groups["dp"][1], seq_shards=tuple(seq_shards), device=device)
    key = (world_size, config.dp, device.type)
    if key in _MESHES:
        ctx._mesh = _MESHES[key]
    else:
        _MESHES[key] = ctx.device_mesh
    return ctx


def _cut(tensor: torch.Tensor, layout: Layout, ctx: RankContext) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's piece of a global tensor, and the piece's offset in it."""
    offset = [0] * tensor.dim()
    if layout.batch_dim is not None and ctx.dp > 1:
        sizes = sh.chunk_sizes(tensor.shape[layout.batch_dim], ctx.dp)
        offset[layout.batch_dim] = sh.offsets(sizes)[ctx.dp_rank]
        tensor = sh.shard(tensor, layout.batch_dim, sizes, ctx.dp_rank)
    if layout.seq_dim is not None and layout.seq_sharded:
        offset[layout.seq_dim] = sh.offsets(ctx.seq_shards)[ctx.tp_rank]
        tensor = sh.shard(tensor, layout.seq_dim, ctx.seq_shards, ctx.tp_rank)
    return tensor, tuple(offset)


def _replica_slice(tensor: torch.Tensor, layout: Layout, ctx: RankContext) -> torch.Tensor:
    """The DP replica's part of a global tensor (no sequence cut)."""
    if layout.batch_dim is not None and ctx.dp > 1:
        sizes = sh.chunk_sizes(tensor.shape[layout.batch_dim], ctx.dp)
        return sh.shard(tensor, layout.batch_dim, sizes, ctx.dp_rank)
    return tensor


def rank_batch(inp: torch.Tensor, tgt: torch.Tensor, sharded: Sharded, ctx: RankContext, dtype: torch.dtype):
    """This rank's input (cast to the run dtype, a grad leaf if floating) and target pieces, and
    the input piece's offset in the global input."""
    local_in, offset = _cut(inp, sharded.input_layout, ctx)
    if local_in.is_floating_point():
        local_in = local_in.to(dtype).detach().clone().requires_grad_(True)
    local_tgt, _ = _cut(tgt, sharded.output_layout, ctx)
    if local_tgt.is_floating_point():
        # a float64 target would promote the loss of a low-precision run to float64
        local_tgt = local_tgt.to(dtype)
    return local_in, local_tgt, offset


def forward_loss(case: Case, sharded: Sharded, local_in: torch.Tensor, local_tgt: torch.Tensor,
                 tgt: torch.Tensor, ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded model's local output and this rank's share of the loss: the case's own
    `local_loss`, else the token-loss sum over local tokens / tokens per DP replica."""
    out = sharded.module(local_in)
    if _is_dtensor(out):
        out = out.to_local()
    if sharded.local_loss is not None:
        return out, sharded.local_loss(out, local_tgt, ctx)
    return out, case.loss_sum(out, local_tgt) / case.tokens(_replica_slice(tgt, sharded.output_layout, ctx))


def global_loss(loss: torch.Tensor, sharded: Sharded, ctx: RankContext) -> torch.Tensor:
    """The loss of the whole global batch from each rank's share (a collective, float64)."""
    total = loss.detach().to(torch.float64).clone()
    if sharded.output_layout.seq_sharded and ctx.tp > 1:
        dist.all_reduce(total, group=ctx.tp_group)
    if ctx.dp > 1:
        dist.all_reduce(total, group=ctx.dp_group)
        total /= ctx.dp
    return total


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _param_piece(ref: torch.Tensor, spec: ParamSpec, ctx: RankContext) -> tuple[torch.Tensor, tuple[int, ...]]:
    if spec.index is not None:
        return spec.index(ref), ()
    if spec.dim is None:
        return ref, ()
    sizes = spec.sizes or sh.chunk_sizes(ref.shape[spec.dim], ctx.tp)
    offset = [0] * ref.dim()
    offset[spec.dim] = sh.offsets(sizes)[ctx.tp_rank]
    return sh.shard(ref, spec.dim, sizes, ctx.tp_rank), tuple(offset)


class _Param:
    """One local parameter and where it lives in the reference."""

    def __init__(self, local_name: str, param: nn.Parameter, spec: ParamSpec | None):
        self.local_name = local_name
        self.param = param
        self.dtensor = _is_dtensor(param)
        self.spec = spec or ParamSpec(ref_name=local_name)
        if self.dtensor:
            from torch.distributed.tensor import Replicate

            self.replicated_tp = all(isinstance(p, Replicate) for p in param.placements)
        else:
            self.replicated_tp = self.spec.dim is None and self.spec.index is None

    def local(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.to_local() if _is_dtensor(t) else t

    def piece_of(self, ref: torch.Tensor | None, ctx: RankContext) -> torch.Tensor | None:
        """This rank's piece of a reference tensor (the whole tensor for DTensor params)."""
        if ref is None or self.dtensor:
            return ref
        return _param_piece(ref, self.spec, ctx)[0]

    def full_or_piece(self, t: torch.Tensor | None, ref64: torch.Tensor, ref_lp: torch.Tensor, ctx: RankContext):
        """(value to judge, matching ref64 piece, ref_lp piece, offset)."""
        if self.dtensor:
            value = None if t is None else t.full_tensor()
            return value, ref64, ref_lp, ()
        piece64, offset = _param_piece(ref64, self.spec, ctx)
        piece_lp, _ = _param_piece(ref_lp, self.spec, ctx)
        return t, piece64, piece_lp, offset


def _reference_step(model: nn.Module, case: Case, inp: torch.Tensor, tgt: torch.Tensor, dtype: torch.dtype,
                    noise: RoundingNoise | None = None):
    x = inp.to(dtype) if inp.is_floating_point() else inp
    tgt = tgt.to(dtype) if tgt.is_floating_point() else tgt
    if noise is not None and x.is_floating_point():
        x = perturb_(x.clone(), noise.rel, noise.gen)
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    with noise if noise is not None else contextlib.nullcontext():
        out = model(x)
        if out.requires_grad:
            out.retain_grad()
        loss = case.loss_sum(out, tgt) / case.tokens(tgt)
        loss.backward()
    return RefStep(out=out.detach(), loss=loss.detach(), input_grad=x.grad if x.is_floating_point() else None,
                   out_grad=out.grad)


@dataclass(kw_only=True)
class RefStep:
    """One reference forward + backward."""

    out: torch.Tensor
    loss: torch.Tensor
    input_grad: torch.Tensor | None
    out_grad: torch.Tensor | None
    """d loss / d output: what the loss's error bound propagates the output's error through."""


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


def run_rank(config: CheckConfig) -> RankResult:
    """The job: one side-by-side run of `config` on this rank."""
    t_start = time.perf_counter()
    case = get_case(config.case)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ctx = make_context(config, device)
    dtype = config.torch_dtype
    lp = lp_dtype(dtype)
    result = RankResult(rank=ctx.rank)

    ref64 = case.build_reference(config).to(device=device, dtype=torch.float64)
    ref_lp = copy.deepcopy(ref64).to(lp)
    # the backward-error reference: see sp_harness.compare.tolerance
    alt_gen = torch.Generator().manual_seed(config.seed + 104729)
    ref_alt = copy.deepcopy(ref64)
    accumulator = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    alt_noise = RoundingNoise(torch.finfo(dtype).eps, alt_gen, torch.finfo(accumulator).eps,
                              matmul_input_precision(config, device))
    sharded: Sharded = case.shard(copy.deepcopy(ref64).to(dtype), ctx)
    module = sharded.module
    spec_of = dict(sharded.params)
    params = [_Param(n, p, spec_of.get(n)) for n, p in module.named_parameters()]
    ref_params64 = dict(ref64.named_parameters())
    ref_params_lp = dict(ref_lp.named_parameters())
    ref_params_alt = dict(ref_alt.named_parameters())
    unknown = sorted({p.spec.ref_name for p in params} - set(ref_params64))
    if unknown:
        raise RuntimeError(f"case {case.name} maps local params to names the reference lacks: {unknown}")
    covered = {p.spec.ref_name for p in params}
    missing = sorted(set(ref_params64) - covered)
    if missing:
        raise RuntimeError(f"case {case.name}: reference params with no sharded counterpart: {missing}")
    hint = set(case.replicated_hint)
    shapes = {n: t.shape for n, t in ref_params64.items()}

    opt = make_optimizer(config.optimizer, config.lr, module.parameters())
    counter = CommCounter(ctx.group_label)
    gen = torch.Generator().manual_seed(config.seed + 7919)
    adversary, platform = _adversaries(config, ctx)
    traced = not any(p.dtensor for p in params)  # DTensor outputs do not line up with plain ones
    # modules holding a TP-sharded param return pieces or partial sums: not comparable
    pieces = frozenset(p.local_name.rpartition(".")[0] for p in params if not p.replicated_tp)
    recorders = [Recorder(m, pieces) for m in (module, ref64, ref_lp, ref_alt)] if traced else []
    result.timings["setup_s"] = time.perf_counter() - t_start
    t_compute = 0.0

    def judge(kind, name, step, got, want64, want_lp, offset=(), want_alt=None, extra=0.0, dof=0):
        record(result, check_tensor(kind=kind, name=name, step=step, rank=ctx.rank, got=got, ref64=want64,
                                    ref_lp=want_lp, dtype=dtype, offset=offset, ref_alt=want_alt, extra_allowed=extra,
                                    dof=dof))

    # the sharded factory must start from the reference's weights (cast to the run dtype)
    for p in params:
        got, w64, _, off = p.full_or_piece(p.param.detach(), ref_params64[p.spec.ref_name].detach(),
                                           ref_params64[p.spec.ref_name].detach(), ctx)
        record(result, check_bounded(kind="init", name=p.spec.ref_name, step=0, rank=ctx.rank, got=got,
                                     want=w64.to(dtype), bound=torch.zeros_like(w64), offset=off))

    for step in range(config.steps):
        inp, tgt = case.make_batch(config, step, gen)
        inp, tgt = inp.to(device), tgt.to(device)
        _anchor(gather_full(params, shapes, ctx), ref_params64, ref_params_lp, ref_params_alt, dtype, alt_gen)
        for r in recorders:
            r.clear()
        failures_before = len(result.failures)
        r64 = _reference_step(ref64, case, inp, tgt, torch.float64)
        with platform:
            r_lp = _reference_step(ref_lp, case, inp, tgt, lp)
        r_alt = _reference_step(ref_alt, case, inp, tgt, torch.float64, noise=alt_noise)
        out64, loss64, ig64 = r64.out, r64.loss, r64.input_grad
        out_lp, loss_lp, ig_lp = r_lp.out, r_lp.loss, r_lp.input_grad
        out_alt, loss_alt, ig_alt = r_alt.out, r_alt.loss, r_alt.input_grad

        local_in, local_tgt, in_offset = rank_batch(inp, tgt, sharded, ctx, dtype)

        t0 = time.perf_counter()
        with counter, adversary:
            counter.phase = "forward"
            out, loss = forward_loss(case, sharded, local_in, local_tgt, tgt, ctx)
            counter.phase = "backward"
            loss.backward()
            counter.phase = "grad_sync"
            sharded.sync_grads()
        t_compute += time.perf_counter() - t0

        # --- compare forward, loss, input grad, param grads (what the optimizer will see)
        want_out64, out_offset = _cut(out64, sharded.output_layout, ctx)
        want_out_lp, _ = _cut(out_lp, sharded.output_layout, ctx)
        want_out_alt, _ = _cut(out_alt, sharded.output_layout, ctx)
        local_tokens, tokens = case.tokens(local_tgt), case.tokens(tgt)
        judge("forward", "output", step, out, want_out64, want_out_lp, out_offset, want_out_alt, dof=local_tokens)
        total = global_loss(loss, sharded, ctx)
        judge("loss", "loss", step, total, loss64, loss_lp, (), loss_alt,
              extra=_loss_allowance(r64, r_lp, r_alt, dtype))
        result.losses.append(float(total))
        if ig64 is not None:
            # DDP's convention: each replica's loss is the mean over its own micro-batch, so its
            # input grad is the global-mean reference's times (global tokens / replica tokens)
            ig_scale = case.tokens(tgt) / case.tokens(_replica_slice(tgt, sharded.output_layout, ctx)) \
                if ctx.dp > 1 else 1.0
            want64, in_off = _cut(ig64 * ig_scale, sharded.input_layout, ctx)
            want_lp, _ = _cut(ig_lp * ig_scale, sharded.input_layout, ctx)
            want_alt, _ = _cut(ig_alt * ig_scale, sharded.input_layout, ctx)
            judge("input_grad", "input", step, local_in.grad, want64, want_lp, in_off, want_alt, dof=local_tokens)
        for p in params:
            ref = p.spec.ref_name
            got, w64, wlp, off = p.full_or_piece(p.param.grad, ref_params64[ref].grad, ref_params_lp[ref].grad, ctx)
            walt = p.piece_of(ref_params_alt[ref].grad, ctx)
            judge("grad", ref, step, got, w64, wlp, off, walt, dof=tokens)

        if recorders and not failures_before and len(result.failures) > failures_before:
            result.divergence = first_divergence(
                step=step, rank=ctx.rank, sharded=recorders[0], ref64=recorders[1], ref_lp=recorders[2],
                ref_alt=recorders[3], dtype=dtype, seq_len=config.seq_len, seq_shards=ctx.seq_shards,
                tp_rank=ctx.tp_rank)

        # --- the optimizer stage, judged on the sharded run's own params, grads and state
        expected = [_expected_step(p, opt, config, dtype, ctx) for p in params]
        t0 = time.perf_counter()
        with counter:
            counter.phase = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
        t_compute += time.perf_counter() - t0
        for m in (ref64, ref_lp, ref_alt):
            m.zero_grad(set_to_none=True)
        result.comm.append(counter.snapshot())
        counter.stats.clear()

        for p, (want, bound) in zip(params, expected, strict=True):
            got = p.param.detach().full_tensor() if p.dtensor else p.param.detach()
            off = () if p.dtensor else _param_piece(ref_params64[p.spec.ref_name], p.spec, ctx)[1]
            record(result, check_bounded(kind="param", name=p.spec.ref_name, step=step, rank=ctx.rank,
                                         got=got, want=want, bound=bound, offset=off))
        result.drift.extend(_replica_drift(step, params, ctx, hint))

    for r in recorders:
        r.remove()
    result.timings["compute_s"] = t_compute
    result.timings["total_s"] = time.perf_counter() - t_start
    return result


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


def _anchor(full: dict[str, torch.Tensor], ref64: dict, ref_lp: dict, ref_alt: dict, dtype: torch.dtype,
            gen: torch.Generator) -> None:
    """Load the sharded run's current params into the three references (see sp_harness.step.anchor)."""
    with torch.no_grad():
        for name, value in full.items():
            ref64[name].copy_(value)
            ref_lp[name].copy_(value)
            perturb_(ref_alt[name].copy_(value), torch.finfo(dtype).eps, gen)


def _expected_step(p: _Param, opt: torch.optim.Optimizer, config: CheckConfig, dtype: torch.dtype,
                   ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    """This param after the coming optimizer step, in float64 from its own values, and the bound."""
    to_full = (lambda t: t.full_tensor()) if p.dtensor else (lambda t: t)
    value = to_full(p.param.detach())
    grad = None if p.param.grad is None else to_full(p.param.grad)
    ref = reference_step(optimizer=config.optimizer, lr=config.lr, param=value, grad=grad,
                         state=state_of(opt, p.param, to_full), dtype=dtype)
    return ref.param, ref.bound


def _replica_drift(step: int, params: list[_Param], ctx: RankContext, hint: set[str]) -> list[Drift]:
    """Bit-for-bit comparison of replicated params across TP ranks, and of all params across DP."""
    drifts = []
    checks = []
    if ctx.tp > 1:
        checks.append(("tp", ctx.tp_group, ctx.tp_ranks, [p for p in params if p.replicated_tp or p.spec.ref_name in hint]))
    if ctx.dp > 1:
        checks.append(("dp", ctx.dp_group, ctx.dp_ranks, params))
    for label, group, ranks, plist in checks:
        if not plist:
            continue
        # one flat buffer, one collective: bookkeeping cost independent of the parameter count
        flat = torch.cat([p.local(p.param.detach()).reshape(-1).to(torch.float64) for p in plist])
        gathered = [torch.empty_like(flat) for _ in ranks]
        dist.all_gather(gathered, flat, group=group)
        diffs = torch.stack([(g - flat).abs() for g in gathered]).amax(0)
        at = 0
        for p in plist:
            n = p.local(p.param).numel()
            d = float(diffs[at:at + n].max()) if n else 0.0
            at += n
            if d > 0 or not torch.isfinite(torch.tensor(d)):
                drifts.append(Drift(step=step, name=p.spec.ref_name, group=label, max_abs=d, ranks=ranks))
    return drifts
