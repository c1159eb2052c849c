"""Stage: step. The optimizer step's reference and its rounding bound, pure and process-group free.

The optimizer stage is judged on the sharded run's own inputs to it: its parameters, the grads
it is about to apply and its optimizer state, all taken just before `step()`. The float64
reference of that one step is then exact up to float64 rounding, and what a correct run in the
run's dtype may differ by is the rounding of a handful of elementwise ops, bounded element by
element (Higham's model, fl(a op b) = (a op b)(1 + d), |d| <= u):

    AdamW  p' = p (1 - lr wd) - step_size * m' / (sqrt(v') / sqrt(bc2) + eps)
           m' = lerp(m, g, 1 - b1),  v' = b2 v + (1 - b2) g^2
    bound  = eps * (P |p| + C (|p' - p| + step_size * (|m'| + (1 - b1) (|m| + |g|)) / denom))

The lerp m + (1 - b1)(g - m) rounds its result (|m'|) and, inside, g - m and its product with
1 - b1 (each at most (1 - b1)(|m| + |g|) after the product, where m' may cancel): not the whole
|m| + |g|, which at AdamW's first steps is 5-10 times the update and hid a bf16 update off by
30%. Every term of v' is non-negative, so its rounding is relative and folds into the |p' - p|
term. The update u = step_size m' / denom
rounds about 5 times relative to itself (m' once, v' twice, sqrt, / sqrt(bc2) and + eps once
each, through denom), and the two terms C multiplies are each at least |u|: C = 4 units of eps
(8 unit roundoffs per term, 16 on |u|) is three times that count (it was 8 until bfloat16's
update check had to see a few percent: 8 eps |u| x 2 terms is 12% of the update in bf16). Only
three roundings happen at the parameter's own magnitude: the decay factor 1 - lr wd (a float32
run's scalar is rounded to float32), the decayed p and the final sum. So |p| gets P = 2 units
of eps (4 unit roundoffs: those three and a fourth, for a master weight the optimizer updates
that the param was rounded down from). |p| is the largest term by far in a low-precision run
(bf16's eps |p| is about the whole update at lr 1e-2), so its coefficient is what the update
check can see: float32 AdamW reached 2.3 unit roundoffs of |p| over 600 random steps
(tests/test_tolerance_parts.py).

Nothing is carried from one step to the next: an error in step k's grads cannot be amplified by
AdamW's 1/sqrt(v) into step k+1's bound (that amplification, on an element whose grad was 26x
AdamW's eps, is what made the previous model false-alarm on AVX-512 CPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUNDINGS = 4.0
"""C above: units of eps(dtype) per bound term of the update, from counting its roundings."""
PARAM_ROUNDINGS = 2.0
"""P above: units of eps(dtype) on |p|, the roundings at the parameter's own magnitude."""

ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
WEIGHT_DECAY = 0.01
SGD_MOMENTUM = 0.9


@dataclass(kw_only=True)
class OptimState:
    """One parameter's optimizer state before the step, in float64."""

    step: int = 0
    """Steps already taken (0: no state yet)."""
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    momentum_buffer: torch.Tensor | None = None


@dataclass(kw_only=True)
class StepReference:
    param: torch.Tensor
    """Expected parameter after the step (float64)."""
    bound: torch.Tensor
    """Per-element allowed |error| for a correct step in the run's dtype."""
    before: torch.Tensor | None = None
    """Where `member` is set: the same sample of the parameter's elements before the step
    (float64)."""
    member: torch.Tensor | None = None
    """A parameter below float32: a sample of its elements (sp_harness.compare.update_scale.sample)
    after the step taken by the unfused implementation in its own dtype (`member_step`), which
    the run's coherent update scale is judged against."""
    scale_slack: float = 0.0
    """A relative uncertainty of the whole step's scale (a clip coefficient the run computes in
    its own precision), which the update-scale check allows on top of its band."""
    state: OptimState | None = None
    """The optimizer state after the step (float64), for a caller that carries it to the next
    step (sp_harness.step.shadow)."""


def make_optimizer(name: str, lr: float, params) -> torch.optim.Optimizer:
    """The optimizer every run uses; `reference_step` is its float64 model."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM)
    return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=WEIGHT_DECAY,
                             foreach=False)


def reference_step(*, optimizer: str, lr: float, param: torch.Tensor, grad: torch.Tensor | None,
                   state: OptimState, dtype: torch.dtype) -> StepReference:
    """One step of `optimizer` in float64 from the given param, grad and state."""
    p = param.detach().to(torch.float64)
    eps = torch.finfo(dtype).eps
    if grad is None:
        return StepReference(param=p, bound=torch.zeros_like(p))
    g = grad.detach().to(torch.float64)
    if optimizer == "sgd":
        buf = g if state.momentum_buffer is None else SGD_MOMENTUM * state.momentum_buffer + g
        new = p - lr * buf
        scale = lr * g.abs() + (new - p).abs()
        if state.momentum_buffer is not None:
            scale = scale + lr * SGD_MOMENTUM * state.momentum_buffer.abs()
        return StepReference(param=new, bound=eps * (PARAM_ROUNDINGS * p.abs() + ROUNDINGS * scale),
                             state=OptimState(step=state.step + 1, momentum_buffer=buf))
    b1, b2 = ADAMW_BETAS
    m = torch.zeros_like(p) if state.exp_avg is None else state.exp_avg
    v = torch.zeros_like(p) if state.exp_avg_sq is None else state.exp_avg_sq
    t = state.step + 1
    m_new = m + (1 - b1) * (g - m)
    v_new = b2 * v + (1 - b2) * g * g
    step_size = lr / (1 - b1 ** t)
    denom = v_new.sqrt() / (1 - b2 ** t) ** 0.5 + ADAMW_EPS
    decayed = p * (1 - lr * WEIGHT_DECAY)
    new = decayed - step_size * m_new / denom
    scale = (new - p).abs() + step_size * (m_new.abs() + (1 - b1) * (m.abs() + g.abs())) / denom
    return StepReference(param=new, bound=eps * (PARAM_ROUNDINGS * p.abs() + ROUNDINGS * scale),
                         state=OptimState(step=t, exp_avg=m_new, exp_avg_sq=v_new))


def member_step(*, optimizer: str, lr: float, param: torch.Tensor, grad: torch.Tensor,
                raw_state: dict) -> torch.Tensor:
    """`param` after the step `make_optimizer` takes in `param`'s own dtype, on clones of `param`,
    `grad` and the optimizer state `raw_state` (its tensors as the optimizer holds them): the
    unfused member of the correct implementations a low-precision step is judged against
    (sp_harness.compare.update_scale), every intermediate rounded to the parameter's dtype."""
    clone = torch.nn.Parameter(param.detach().clone(), requires_grad=True)
    clone.grad = grad.detach().clone().to(clone.dtype)
    opt = make_optimizer(optimizer, lr, [clone])
    if raw_state:
        opt.state[clone] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in raw_state.items()}
    opt.step()
    return clone.detach()


def raw_state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, to_full) -> dict:
    """`param`'s optimizer state as held (dtype kept), each tensor through `to_full`; the step
    count as is."""
    raw = optimizer.state.get(param, {})
    return {k: (to_full(v) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in raw.items()}


def state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, to_full) -> OptimState:
    """`param`'s state in `optimizer` before its next step, each tensor through `to_full`
    (local piece, or a DTensor's full tensor) and in float64."""
    return float64_state(raw_state_of(optimizer, param, to_full))


def float64_state(raw: dict) -> OptimState:
    """A state as `raw_state_of` returns it, in float64."""
    if not raw:
        return OptimState()

    def conv(key):
        t = raw.get(key)
        return None if t is None else t.detach().to(torch.float64)

    step = raw.get("step", 0)
    return OptimState(step=int(step.item() if isinstance(step, torch.Tensor) else step),
                      exp_avg=conv("exp_avg"), exp_avg_sq=conv("exp_avg_sq"),
                      momentum_buffer=conv("momentum_buffer"))
