"""Stage: checks. The training-step check's rank job (sp_harness.checks.train_step drives it).

Each step: K micro-batches with uneven valid-token masks (sp_harness.step.train_batches); the
references (float64, same-precision, perturbed: sp_harness.checks.references) run the intended
loss (`Case.train_loss`) over the whole global batch at once, anchored at the run's params, while
the case's own step (`Sharded.train_step`) accumulates over its micro-batches. Then, stage by
stage (1-2 by the side-by-side check's tolerance model, 3-5 by bounds derived from their own
arithmetic: docs/tolerance.md, "The training-step check's bounds"):

1. reported loss   the loss the step reports vs the intended loss
2. grad            the grads it leaves before clipping vs the intended loss's grads; where they
                   fail, the one factor that best maps the reference's onto them (a uniform
                   factor is a normalisation or averaging error)
3. grad_norm       which params its norm counts (step 0: the norm of each param alone, every
                   other grad zeroed, vs that param's own) and the norm it reports vs the float64
                   norm of its own grads
4. clip            (SGD, clipping active) the coefficient its update applied vs
                   min(1, max_norm / (norm + 1e-6)) of its own grads
5. param           its update vs the float64 step from its own grads, clipped by that coefficient

Stages 3-5 start from the run's own grads, so a wrong grad fails at stage 2 alone. A figure whose
bound cannot tell it from the wrong value its stage exists to catch (a share from 0, a clip
coefficient from either end of [0, 1]) is not judged and the result says so, never "ok".

Every collective the engine adds here runs on every rank, whatever that rank's own verdict or
data: a rank's grads may fail alone (at DP 1 the rank holding no valid token is the only one a
missing sequence-group sync leaves wrong), and a DTensor grad one rank's step left None still
takes part in its gather (`LocalParam.gathered`, in float64: a buffer's dtype may differ by rank).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from sp_harness.checks.references import KINDS, RefResult
from sp_harness.checks.side_by_side_rank import _expected_step, _loss_allowance, _SideBySide, drive
from sp_harness.compare.tensor_check import TensorCheck, check_bounded
from sp_harness.compare.tolerance import eps
from sp_harness.compare.update_scale import sample as scale_sample
from sp_harness.compare.update_scale import update_scales
from sp_harness.config.case import Batch
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.step_protocol import TrainStep, grad_reader
from sp_harness.judge.verdict import RankResult, record
from sp_harness.step.inputs import batch_to, target_layout
from sp_harness.step.optim_ref import StepReference, member_step, raw_state_of
from sp_harness.step.params import LocalParam
from sp_harness.step.shadow import ShadowOptimizer, ShadowStep
from sp_harness.step.train_batches import concatenated, micro_batch, micro_batches

CLIP_EPS = 1e-6
"""The clip coefficient's guard, min(1, max_norm / (norm + CLIP_EPS)): torch.nn.utils.clip_grad_norm_
and Megatron's clip_grad_by_total_norm_fp32 both add 1e-6."""
CLIP_NOT_JUDGED = "clip coefficient not judged: its bound reaches the distance from the coefficient to 1"
"""The not-run line of a clip coefficient too close to 1 for its bound (once per run)."""
UNIFORM_FIT = 0.05
"""A failing grad set is reported as one factor times the reference's when that factor explains
every grad to 5% rms: enough to name "grads x 0.5" under bfloat16's own rounding (0.4% per
element), too tight for a set of unrelated errors to pass as one."""


def uniform_factor(gw: float, ww: float, gg: float) -> float | None:
    """From <got, want>, <want, want> and <got, got> over every param grad: the one factor that
    maps the reference's grads onto the run's to UNIFORM_FIT rms, or None where none does. A
    factor within that tolerance of 1 explains nothing (the grads are the reference's in
    aggregate; the failure is elsewhere: a missing zero_grad, a local clip norm), so it is None."""
    if ww == 0 or gg == 0:
        return None
    factor = gw / ww
    residual = max(gg - 2 * factor * gw + factor * factor * ww, 0.0)
    if residual <= (UNIFORM_FIT ** 2) * gg and abs(factor - 1.0) > UNIFORM_FIT:
        return factor
    return None


def _scalar(x: float) -> torch.Tensor:
    """A figure as a 1-element float64 tensor (torch.tensor([x]) alone rounds it to float32)."""
    return torch.tensor([x], dtype=torch.float64)


def _global(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _any_rank(flag: bool) -> bool:
    """Whether any rank says `flag`: what lets every rank take the same branch into a collective."""
    return bool(_global(torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)).item())


def _judged(*, kind: str, name: str, step: int, rank: int, got: float, want: float, bound: float,
            apart: float) -> TensorCheck:
    """One figure within `bound` of `want`, judged only where the bound is below `apart`, the
    distance from `want` to the wrong value its stage exists to catch (a share's own size: the
    param left out of the norm, or counted twice). Otherwise withheld (TensorCheck.vacuous: the
    result lists it as not judged, with the bound over that distance), as the tolerance model
    withholds a piece whose bounds would pass a zero tensor; a non-finite figure is still judged."""
    chk = check_bounded(kind=kind, name=name, step=step, rank=rank, got=_scalar(got), want=_scalar(want),
                        bound=_scalar(bound))
    if apart > 0 and bound >= apart and math.isfinite(got):
        chk.vacuous = bound / apart
        chk.withheld_ratio, chk.ratio, chk.ok = chk.ratio, 0.0, True
    return chk


def _clip_check(*, step: int, rank: int, got: float, coef: float, bound: float) -> tuple[TensorCheck | None, str]:
    """The clip coefficient the update applied (`got`) against the intended `coef`: judged where
    `bound` separates `coef` from both ends of its range, withheld (`_judged`) where a coefficient
    of 0, an update never applied, would pass; where only 1 (never clipped) would, no check and the
    not-run line why."""
    if 1.0 - coef <= bound < coef:
        return None, (f"{CLIP_NOT_JUDGED} (step {step}: bound {bound:.3g} >= 1 - {coef:.3g}): an update never "
                      f"clipped would pass it; the update stage still judges the step")
    return _judged(kind="clip", name="clip coefficient", step=step, rank=rank, got=got, want=coef, bound=bound,
                   apart=coef), ""


class _TrainStepRun(_SideBySide):
    """The case's own training step on one rank, judged stage by stage."""

    def __init__(self, config: CheckConfig):
        super().__init__(config)
        train = self.sharded.train_step
        if train is None:
            raise ValueError(f"case {config.case} declares Case.train_loss but its shard set no Sharded.train_step")
        if not isinstance(train, TrainStep):
            raise TypeError(f"case {config.case}: Sharded.train_step is a {type(train).__name__}, not a TrainStep "
                            f"(accumulate, grad_norm, step and optimizer)")
        self.train = train
        assert self.case.train_loss is not None, "the driver refuses a case without train_loss"
        self.loss_spec = self.case.train_loss
        self.step_opt = train.optimizer
        self.read_grad = grad_reader(train)
        # frameworks sum the squares in float32 below float32 (megatron's float32 main grads,
        # torch's norm kernels' float32 accumulator), the run dtype otherwise
        self.norm_dtype = self.precision.accumulator
        self.shadow: ShadowOptimizer | None = None
        if self.step_opt is None:
            assert config.optimizer is not None and config.lr is not None, "the check resolves optimizer and lr"
            # master copies and state in float32, as the frameworks keep them (float64 in a float64 run)
            self.shadow = ShadowOptimizer(optimizer=config.optimizer, lr=config.lr,
                                          master_dtype=self.precision.step_dtype, param_dtype=self.dtype)

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return super().grad_of(param) if self.read_grad is None else self.read_grad(param)

    def _scaled(self, refs: dict[str, RefResult], tokens: int) -> dict[str, RefResult]:
        """The references' token mean as the declared reduction: 'sum' is the mean times the
        valid-token count, exact in float64 (and one rounding in the others)."""
        if self.loss_spec.reduction == "token-mean":
            return refs
        for r in refs.values():
            r.step.loss = r.step.loss * tokens
            if r.step.out_grad is not None:
                r.step.out_grad = r.step.out_grad * tokens
            r.grads = {n: None if g is None else g * tokens for n, g in r.grads.items()}
        return refs

    def own_grads(self) -> dict[int, torch.Tensor | None]:
        return {id(p.param): self.grad_of(p.param) for p in self.params}

    def norm_shares(self, grads: dict[int, torch.Tensor | None]) -> dict[str, float]:
        """Each reference param's squared norm from the run's own grads, float64, every piece
        counted once: a TP-split param's pieces summed over TP, a replicated one taken once."""
        names = sorted({p.spec.ref_name for p in self.params})
        local = torch.zeros(len(names), dtype=torch.float64)
        for p in self.params:
            g = grads[id(p.param)]
            g = p.gathered(g, via=torch.float64)
            if g is None:
                continue
            sq = g.to(torch.float64).pow(2).sum()
            # a replicated param (or a DTensor's whole tensor) is held by every TP rank: its
            # sum over TP counts it tp times; DP replicas are identical and are divided out
            share = sq / self.ctx.tp if (p.replicated_tp or p.dtensor) else sq
            local[names.index(p.spec.ref_name)] += share / self.ctx.dp
        return dict(zip(names, _global(local).tolist(), strict=True))

    def _norm_bound(self, sq: float, numel: int) -> float:
        """What a correct norm's square may differ by, in any summation order, from the float64
        norm of the same grads: `numel` squares summed on a rank, the ranks' sums added, the
        square root and its square, all in the norm's accumulator (Higham's gamma_m = m u / (1 - m
        u), u = eps / 2, m = numel + world size + 2); each of those world size + 2 scalar steps
        done in the run dtype instead, where it is coarser (torch's norm of bfloat16 grads
        returns bfloat16, and a DTensor's partial norms are squared, all-reduced and rooted in
        it: at most 2 u_run on the square each, of which gamma already counted 2 u_acc); and the
        result rounded to the run dtype (2 eps on the square: the per-param norms, then their
        total). torchtitan's step at TP 2, bfloat16: a share 1.17% off (3 u_run), where the first
        and last terms alone allow 1.58%."""
        u = eps(self.norm_dtype) / 2
        m_u = min((numel + self.config.world_size + 2) * u, 0.5)
        scalar_steps = (self.config.world_size + 2) * (eps(self.dtype) - eps(self.norm_dtype))
        return sq * (m_u / (1 - m_u) + scalar_steps + 2 * eps(self.dtype))

    def judge_composition(self, step: int, grads: dict[int, torch.Tensor | None], shares: dict[str, float]) -> None:
        """Which params the step's norm counts, and how often: its norm of each param alone
        (where the step can compute its norm outside its step: `TrainStep.grad_norm`)."""
        if self.train.grad_norm() is None:
            return
        saved = {k: None if g is None else g.detach().clone() for k, g in grads.items()}
        numel = {p.spec.ref_name: p.full(p.param.detach()).numel() for p in self.params}
        try:
            for name in sorted(shares):
                for p in self.params:
                    g, kept = grads[id(p.param)], saved[id(p.param)]
                    if g is not None and kept is not None:
                        g.detach().copy_(kept if p.spec.ref_name == name else torch.zeros_like(g))
                norm = self.train.grad_norm()
                assert norm is not None, "a step whose norm was computable a moment ago"
                want = shares[name]
                # left out (0) or counted twice (2x): either is the share itself away
                record(self.result, _judged(kind="grad_norm", name=f"{name} in the norm", step=step,
                                            rank=self.ctx.rank, got=float(norm) ** 2, want=want,
                                            bound=self._norm_bound(want, numel[name]), apart=want))
        finally:
            for p in self.params:
                g, kept = grads[id(p.param)], saved[id(p.param)]
                if g is not None and kept is not None:
                    g.detach().copy_(kept)

    def judge_uniform(self, step: int, refs: dict[str, RefResult], failed: bool) -> None:
        """Where grads failed on any rank (`failed`: on this one): the factor that best maps the
        reference's grads onto the run's. Every rank calls it every step: its sums are collectives,
        and a rank's grads may fail alone."""
        if not _any_rank(failed):
            return
        sums = torch.zeros(3, dtype=torch.float64)
        for p in self.params:
            g = self.grad_of(p.param)
            got = p.gathered(g, via=torch.float64)
            want = refs["r64"].grads[p.spec.ref_name]
            if got is None or want is None:
                continue
            got, w64 = got.to(torch.float64), p.piece_of(want, self.ctx)
            sums += torch.stack([(got * w64).sum(), (w64 * w64).sum(), (got * got).sum()])
        factor = uniform_factor(*_global(sums).tolist())
        if factor is not None:  # a later step's failed fit does not erase an earlier step's factor
            self.result.grad_factor = factor

    def clip_coefficient(self, norm_sq: float) -> float:
        limit = self.config.clip_grad_norm
        return 1.0 if limit is None else min(1.0, limit / (norm_sq ** 0.5 + CLIP_EPS))

    def judge_clip(self, step: int, before: dict[int, torch.Tensor], buffers: dict[int, torch.Tensor | None],
                   grads: dict[int, torch.Tensor | None], coef: float, coef_rel: float,
                   bounds: dict[int, torch.Tensor]) -> None:
        """SGD with active clipping: the coefficient its update applied, from p' = p - lr buf and
        buf = momentum buf_prev + coef g: one least-squares fit over every element. Each element's
        update may be off by its own bound (`bounds`, the update check's), which moves the fit by
        at most sum |g| bound / lr over sum g^2: a bfloat16 param rounds away an update of
        lr * coef * g far below its eps, and then the fit can say nothing."""
        from sp_harness.step.optim_ref import SGD_MOMENTUM

        assert self.config.lr is not None, "the check resolves lr"
        sums = torch.zeros(3, dtype=torch.float64)
        for p in self.params:
            # a DTensor's whole tensor (gathered on every rank alike, `LocalParam.gathered`) is on every TP
            # rank, as a replicated param is
            after = p.full(p.param.detach()).to(torch.float64)
            prev = p.gathered(buffers[id(p.param)], via=torch.float64)
            g = p.gathered(grads[id(p.param)], via=torch.float64)
            if g is None:
                continue
            applied = (before[id(p.param)] - after) / self.config.lr
            if prev is not None:
                applied = applied - SGD_MOMENTUM * prev
            g = g.to(torch.float64)
            weight = 1.0 / self.ctx.tp if (p.replicated_tp or p.dtensor) else 1.0
            slack = (g.abs() * bounds[id(p.param)]).sum() / self.config.lr
            sums += weight * torch.stack([(applied * g).sum(), (g * g).sum(), slack])
        ag, gg, slack = _global(sums).tolist()
        if gg == 0:
            return
        chk, why = _clip_check(step=step, rank=self.ctx.rank, got=ag / gg, coef=coef,
                               bound=coef * coef_rel + slack / gg)
        if chk is not None:
            record(self.result, chk)
        elif not any(n.startswith(CLIP_NOT_JUDGED) for n in self.result.not_run):
            self.result.not_run.append(why)

    def start_step(self, step: int, gen: torch.Generator, mask_ctx: RankContext) -> tuple[list[Batch], Batch, int]:
        """Step `step`'s micro-batches (masked as `mask_ctx`'s mesh holds them), the global batch they
        make and its valid tokens; the references set going on that batch."""
        layout = target_layout(self.sharded.output_layout)
        mbs = [batch_to(b, self.built.device) for b in
               micro_batches(self.case, self.config, step, gen, layout=layout, ctx=mask_ctx)]
        batch_dim = self.case.input_layout.batch_dim
        assert batch_dim is not None, "the driver refuses a case whose input has no batch dim"
        whole = concatenated(mbs, batch_dim)
        self.start_references(whole)
        return mbs, whole, self.case.tokens(whole.target)

    def step(self, step: int, gen: torch.Generator) -> None:
        mbs, _, tokens = self.start_step(step, gen, self.ctx)
        ignore = self.loss_spec.ignore_index
        micro = [micro_batch(self.loop.local_batch(b), ignore) for b in mbs]
        t0 = time.perf_counter()
        with self.counter:
            self.counter.phase = "accumulate"
            reported = self.train.accumulate(micro)
        self.compute_s += time.perf_counter() - t0
        refs = self._scaled(self.finish_references(), tokens)
        r64, r_lp, r_alt = (refs[w].step for w in KINDS)
        loss = torch.as_tensor(reported, dtype=torch.float64).detach().reshape(())
        self.result.losses.append(float(loss))
        # K micro-batch sums added in the run dtype: K more roundings of the loss
        summed = len(mbs) * eps(self.precision.reference) * abs(float(r64.loss))
        self.judge("loss", "reported loss", step, loss, r64.loss, r_lp.loss, (), r_alt.loss,
                   extra=_loss_allowance(r64, r_lp, r_alt, self.dtype) + summed)
        failures = len(self.result.failures)
        self.judge_grads(step, tokens, refs)
        self.judge_uniform(step, refs, failed=any(f.kind == "grad" for f in self.result.failures[failures:]))
        self.norm_and_update(step)

    def norm_and_update(self, step: int) -> None:
        """Stages 3-5, from the run's own grads."""
        grads = self.own_grads()
        shares = self.norm_shares(grads)
        if step == 0:
            self.judge_composition(step, grads, shares)
        norm_sq = sum(shares.values())
        numel = sum(p.full(p.param.detach()).numel() for p in self.params)
        norm_rel = self._norm_bound(norm_sq, numel) / norm_sq if norm_sq else 0.0
        coef = self.clip_coefficient(norm_sq)
        clipping = coef < 1.0
        # a coefficient from a norm off by norm_rel / 2 is off by as much, plus its own two
        # roundings (norm + 1e-6, max_norm / that) where the run computes it in the run dtype (torch's
        # clip_grad_norm_ on bfloat16 grads): it scales the update
        coef_rel = norm_rel / 2 + eps(self.dtype) if clipping else 0.0
        if self.shadow is None:
            expected, before, buffers = self.expected_from_state(grads, coef, coef_rel)
            bounds = {id(p.param): ref.bound for p, ref in zip(self.params, expected, strict=True)}
        else:
            shadowed = dict(zip((id(p.param) for p in self.params), self.expected_from_shadow(grads, coef, coef_rel),
                                strict=True))
            expected = [StepReference(param=s.param, bound=s.bound) for s in shadowed.values()]
            before = {k: s.before for k, s in shadowed.items()}
            buffers = {k: s.momentum_before for k, s in shadowed.items()}
            # the run's master before the step is itself within err_before of the shadow's
            bounds = {k: s.bound + s.err_before for k, s in shadowed.items()}
        own64 = {k: None if g is None else g.detach().to(torch.float64).clone() for k, g in grads.items()}
        t0 = time.perf_counter()
        with self.counter:
            self.counter.phase = "step"
            reported = self.train.step()
        self.compute_s += time.perf_counter() - t0
        got_sq = float(torch.as_tensor(reported, dtype=torch.float64)) ** 2
        record(self.result, _judged(kind="grad_norm", name="reported grad norm (squared)", step=step,
                                    rank=self.ctx.rank, got=got_sq, want=norm_sq,
                                    bound=self._norm_bound(norm_sq, numel), apart=norm_sq))
        if clipping and self.config.optimizer == "sgd":
            self.judge_clip(step, before, buffers, own64, coef, coef_rel, bounds)
        self.judge_update(step, expected)

    def expected_from_state(self, grads: dict[int, torch.Tensor | None], coef: float, coef_rel: float):
        """Each param's update from the run's own params, grads (clipped by `coef`) and readable
        optimizer state; the params and SGD momentum buffers before it."""
        assert self.step_opt is not None, "the shadow judges a step whose state is not readable"
        opt = self.step_opt
        before = {id(p.param): p.full(p.param.detach()).to(torch.float64, copy=True) for p in self.params}
        buffers = {id(p.param): _momentum(opt, p.param) for p in self.params}
        self.loop.load_grads()
        expected, slacks = [], []
        # global conditions only: the slack's state and grad gathers run on every rank
        scaled = coef < 1.0 and self.precision.update_scale
        for p in self.params:
            g = p.param.grad
            if g is None or coef >= 1.0:
                expected.append(_expected_step(p, opt, self.config, self.dtype))
            else:
                kept = g.detach().clone()
                g.mul_(coef)  # in the grad's dtype, as the step's clipping does
                expected.append(_expected_step(p, opt, self.config, self.dtype))
                g.copy_(kept)
            slacks.append(self._scale_slack(p, opt, expected[-1], g, coef, coef_rel) if scaled else coef_rel)
        for ref, p, slack in zip(expected, self.params, slacks, strict=True):
            ref.bound = ref.bound + (ref.param - before[id(p.param)]).abs() * coef_rel
            ref.scale_slack = slack
        return expected, before, buffers

    def _scale_slack(self, p: LocalParam, opt: torch.optim.Optimizer, ref: StepReference,
                     grad: torch.Tensor | None, coef: float, coef_rel: float) -> float:
        """How far the update-scale check must let the run's step sit from the member's for a
        coefficient anywhere in coef (1 +- coef_rel): the unfused member stepped at both ends, and
        the larger move of its coherent scale from the member's at `coef` (at least coef_rel).
        Where the final rounding dithers the step that move is coef_rel; where bfloat16 grads put
        many elements' steps on one rounding boundary (or a few near it carry the weight) a
        coefficient 0.4% off flips them together: megatron-gpt-sp's correct step at TP 2,
        bfloat16, SGD, clip 0.01, seed 26 had its tok_emb step 1.62x the exact one (coefficient
        rounded to bfloat16 first). Each element's rounding is monotone in the coefficient, so a
        run whose coefficient lies in the interval lands between the ends. A collective for a
        DTensor (its state, value and grad gathered): every rank calls it for every param."""
        to_full = (lambda t: t.full_tensor()) if p.dtensor else (lambda t: t)
        raw = raw_state_of(opt, p.param, to_full)
        value = p.full(p.param.detach())
        grad = p.gathered(grad, via=torch.float64)
        if ref.member is None or ref.before is None or grad is None:
            return coef_rel
        assert self.config.optimizer is not None and self.config.lr is not None, "the check resolves them"
        state = {k: scale_sample(v) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in raw.items()}
        ends = [member_step(optimizer=self.config.optimizer, lr=self.config.lr, param=scale_sample(value),
                            grad=scale_sample(grad).clone().mul_(coef * f), raw_state=state)
                for f in (1.0 - coef_rel, 1.0 + coef_rel)]
        at, *moved = update_scales(before=ref.before, exact=scale_sample(ref.param), gots=[ref.member, *ends],
                                   dtype=value.dtype)
        return max(coef_rel, *(abs(m.beta - at.beta) for m in moved))

    def expected_from_shadow(self, grads: dict[int, torch.Tensor | None], coef: float,
                             coef_rel: float) -> list[ShadowStep]:
        """Each param's update by the float64 shadow of the config's optimizer (the step's own
        optimizer state is not readable), from the run's own grads clipped by `coef`."""
        assert self.shadow is not None
        steps = []
        for p in self.params:
            g = grads[id(p.param)]
            steps.append(self.shadow.expect(id(p.param), p.full(p.param.detach()),
                                            p.gathered(g, via=torch.float64),
                                            coef=coef, coef_err=coef * coef_rel))
        return steps


def _momentum(opt: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    buf = opt.state.get(param, {}).get("momentum_buffer")
    return None if buf is None else buf.detach().to(torch.float64).clone()


def run_rank(config: CheckConfig) -> RankResult:
    """The job: one training-step run of `config` on this rank."""
    return drive(_TrainStepRun, config)
