"""Stage: step. A float64 shadow of the config's optimizer, for a training step whose optimizer
state cannot be read per param (`TrainStep.optimizer is None`: fp32 master weights, ZeRO or
distributed-optimizer partitions, a framework's wrapped optimizer).

The update stage normally starts each step from the run's own params and optimizer state
(sp_harness.step.optim_ref), so nothing is carried between steps. Without the state, the shadow
carries its own: it starts from the params before the first step (a master weight is an exact
copy of them then) and takes every step in float64 from the run's own grads, clipped by the
coefficient the run's norm implies. Along with each state value it carries a per-element bound
on how far a correct run's master copy of it may be: each step adds the roundings of that step in
the master's dtype (`reference_step`'s bound, and the state's own roundings below), the grads'
clip rounding and the coefficient's error, and propagates the bound already carried:

    SGD     buf' = mu buf + g                   e_buf' = mu e_buf + e_g + eps (mu |buf| + |buf'|)
            p'   = p - lr buf'                  e_p'   = e_p + lr e_buf' + step bound
    AdamW   m'   = m + (1 - b1)(g - m)          e_m'   = b1 e_m + (1 - b1) e_g + eps (|m'| + (1 - b1)(|m| + |g|))
            v'   = b2 v + (1 - b2) g^2          e_v'   = b2 e_v + (1 - b2)(2 |g| + e_g) e_g + 3 eps v'
            p'   = p (1 - lr wd) - s m' / d     e_p'   = e_p (1 - lr wd) + s (e_m' / d_lo + |m'| e_d / (d d_lo)) + step bound

with d = sqrt(v') / sqrt(bc2) + eps_adam, e_d = e_v' / (sqrt(v') + sqrt(max(v' - e_v', 0))) / sqrt(bc2)
(|sqrt(a) - sqrt(b)| = |a - b| / (sqrt(a) + sqrt(b)), exact) and d_lo = d - e_d. The param the
model holds is its master rounded to the run dtype: judged within e_p' + u (|p'| + e_p').
docs/tolerance.md, "The training-step check's bounds", holds the derivation's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sp_harness.step.optim_ref import ADAMW_BETAS, ADAMW_EPS, SGD_MOMENTUM, WEIGHT_DECAY, OptimState, reference_step


@dataclass(kw_only=True)
class _Shadow:
    """One param's shadow: its master value, optimizer state and their carried bounds (float64)."""

    param: torch.Tensor
    state: OptimState
    err_param: torch.Tensor
    err_state: dict[str, torch.Tensor]


@dataclass(kw_only=True)
class ShadowStep:
    """What one param's step is expected to leave."""

    before: torch.Tensor
    """The shadow master before the step (float64)."""
    err_before: torch.Tensor
    """How far a correct run's master may be from `before`."""
    momentum_before: torch.Tensor | None
    """SGD: the shadow momentum buffer before the step (None at the first step, or AdamW)."""
    param: torch.Tensor
    """The master after the step (float64)."""
    bound: torch.Tensor
    """Per element: how far the run's param (its master rounded to the run dtype) may be from `param`."""


class ShadowOptimizer:
    """The config's optimizer (`optimizer`, `lr`: sp_harness.step.optim_ref's hyper-parameters) in
    float64, one shadow per param key, with the run's master copies in `master_dtype` and its
    params in `param_dtype`."""

    def __init__(self, *, optimizer: str, lr: float, master_dtype: torch.dtype, param_dtype: torch.dtype):
        self.optimizer, self.lr = optimizer, lr
        self.eps = torch.finfo(master_dtype).eps
        self.master_dtype = master_dtype
        self.unit = torch.finfo(param_dtype).eps / 2
        self.shadows: dict[int, _Shadow] = {}

    def expect(self, key: int, value: torch.Tensor, grad: torch.Tensor | None, *, coef: float,
               coef_err: float) -> ShadowStep:
        """The step of param `key` (whose value the run holds now is `value`) with the run's own
        grad `grad` (before clipping), clipped by `coef`, which may be off by `coef_err`. Advances
        the shadow: call it once per param per step."""
        shadow = self.shadows.get(key)
        if shadow is None:
            p = value.detach().to(torch.float64)
            shadow = self.shadows[key] = _Shadow(param=p, state=OptimState(), err_param=torch.zeros_like(p),
                                                 err_state={})
        before, err_before = shadow.param, shadow.err_param
        momentum = shadow.state.momentum_buffer
        if grad is None:  # torch's optimizers skip a param without a grad
            return ShadowStep(before=before, err_before=err_before, momentum_before=momentum, param=before,
                              bound=err_before + self.unit * (before.abs() + err_before))
        g64 = grad.detach().to(torch.float64)
        g = g64 * coef
        # the run multiplies its grad by its coefficient in the grad's dtype (one rounding), and its
        # coefficient may differ from ours by coef_err
        err_g = g64.abs() * (coef_err + coef * torch.finfo(grad.dtype).eps)
        ref = reference_step(optimizer=self.optimizer, lr=self.lr, param=before, grad=g, state=shadow.state,
                             dtype=self.master_dtype)
        assert ref.state is not None, "reference_step returns the state after a step with a grad"
        err_param = self._sgd(shadow, ref.state, g, err_g) if self.optimizer == "sgd" else \
            self._adamw(shadow, ref.state, g, err_g)
        err_param = err_param + ref.bound
        shadow.param, shadow.state, shadow.err_param = ref.param, ref.state, err_param
        return ShadowStep(before=before, err_before=err_before, momentum_before=momentum, param=ref.param,
                          bound=err_param + self.unit * (ref.param.abs() + err_param))

    def _sgd(self, shadow: _Shadow, new: OptimState, g: torch.Tensor, err_g: torch.Tensor) -> torch.Tensor:
        buf, new_buf = shadow.state.momentum_buffer, new.momentum_buffer
        assert new_buf is not None, "an SGD step leaves a momentum buffer"
        if buf is None:  # the first step's buffer is the grad itself
            err_buf = err_g
        else:
            err_buf = SGD_MOMENTUM * shadow.err_state["buf"] + err_g + \
                self.eps * (SGD_MOMENTUM * buf.abs() + new_buf.abs())
        shadow.err_state = {"buf": err_buf}
        return shadow.err_param + self.lr * err_buf

    def _adamw(self, shadow: _Shadow, new: OptimState, g: torch.Tensor, err_g: torch.Tensor) -> torch.Tensor:
        b1, b2 = ADAMW_BETAS
        zero = torch.zeros_like(g)
        m = zero if shadow.state.exp_avg is None else shadow.state.exp_avg
        m_new, v_new = new.exp_avg, new.exp_avg_sq
        assert m_new is not None and v_new is not None, "an AdamW step leaves both moments"
        err_m = shadow.err_state.get("m", zero)
        err_v = shadow.err_state.get("v", zero)
        err_m = b1 * err_m + (1 - b1) * err_g + self.eps * (m_new.abs() + (1 - b1) * (m.abs() + g.abs()))
        err_v = b2 * err_v + (1 - b2) * (2 * g.abs() + err_g) * err_g + 3 * self.eps * v_new
        shadow.err_state = {"m": err_m, "v": err_v}
        t = new.step
        root_bc2 = (1 - b2 ** t) ** 0.5
        denom = v_new.sqrt() / root_bc2 + ADAMW_EPS
        err_denom = err_v / (v_new.sqrt() + (v_new - err_v).clamp(min=0).sqrt()).clamp(min=1e-300) / root_bc2
        err_denom = torch.minimum(err_denom, err_v.sqrt() / root_bc2)
        low = (denom - err_denom).clamp(min=ADAMW_EPS)
        step_size = self.lr / (1 - b1 ** t)
        err_update = step_size * (err_m / low + m_new.abs() * err_denom / (denom * low))
        return shadow.err_param * (1 - self.lr * WEIGHT_DECAY) + err_update


__all__ = ["ShadowOptimizer", "ShadowStep"]
