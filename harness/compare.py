"""Stage: compare. The tolerance model, pure and process-group free.

Every sharded quantity is judged against a float64 reference computed from the same weights and
data. What it may deviate by is not tuned per case: it is measured on the very computation.
Two more references run beside the float64 one and measure what rounding alone does to each
tensor of this very computation:

- `ref_lp`, the same model in the run's precision: its error |ref_lp - ref64| is the rounding
  error of a correct single-device run. For a float64 run there is no higher precision to
  measure against, so ref_lp runs in float32 and its error is scaled by eps64/eps32 (rounding
  error is proportional to the unit roundoff).
- `ref_alt`, float64 with every weight and float input perturbed by a random relative eps(dtype):
  its distance to ref64 is the backward-error view, how far a rounding-sized change moves this
  tensor. It covers what ref_lp can miss: a tensor that is a cancellation of much larger terms
  (the key-bias grad of softmax attention is mathematically zero, so both sides hold pure
  rounding noise, and ref_lp may round it to an exact 0) and AdamW turning such noise into
  lr-sized updates.

The sharded run differs from a correct single-device run only in reduction order and in the
collectives, so its error may be a small factor of those, plus a floor of a few ulps:

    allowed = FACTOR * max(err_lp * eps(dtype) / eps(lp), err_alt) + FLOOR_ULPS * eps(dtype) * scale

with scale = max|ref64| over the tensor. A logic bug (a missing sum, a wrong shard, a stale
replica) shows as an error orders of magnitude above `allowed`; the report gives the ratio.
ref_alt also rounds every intermediate (each op's result, forward and backward) by a random
relative eps(dtype) (sidebyside.RoundingNoise), because a sharded run composes the same math from other ops and so
rounds other intermediates. And for parameters after an AdamW step, an element whose reference
grad is smaller than that grad's allowed error has no determined sign at this precision, and
AdamW's first update is lr * sign(grad): such tensors get 2 * lr per step on top.

History: the ref_alt term and the AdamW term were added after hypothesis found false alarms
(the key-bias grad at one head of dim 1; a bfloat16 v-bias flipping its first Adam update; a
bfloat16 k-weight grad whose bf16 reference, accumulating in fp32, rounded fewer intermediates;
in the nightly run, a saturated bf16 LayerNorm (hidden=2) whose backward kernel on the sharded
side's memory layout cancels at bf16 precision, so the op's inputs are perturbed too).
Model fixes: FACTOR and FLOOR_ULPS unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FACTOR = 16.0
"""How many times the same-precision reference's own error the sharded run may make.

Calibrated once, before any case was declared passing, on 72 correct runs (seed-mlp and
dtensor-gpt, 12 seeds, float64 and float32, 3 steps): at 8 the worst ratio was 0.98 (float64,
a cancellation-heavy bias grad whose f32-measured error underestimates the f64 reorder error)
and 0.73 (float32); 16 leaves a 2x margin. Logic bugs sit 4+ orders of magnitude above."""
FLOOR_ULPS = 8.0
"""Absolute floor, in units of eps(dtype) * max|ref64|: covers tensors the reference happens
to round exactly (its measured error is 0) while a different reduction order does not."""

NORM_FACTOR = 4.0
"""How many times the references' error NORM the sharded run's error norm may reach.

The max-abs bound above must hold for the single worst element of two independent rounding
processes, hence its 16x. A norm over many elements concentrates: the sharded run's rounding
error and the reference's are draws of the same kind of process (other orders, other splits),
so their norms agree to a small factor, while a systematic error (a shard scaled by 1 + d, a
grad missing a small term) adds coherently over the whole shard. 4x over a ratio whose expected
value is about 1 (measured under the reorder adversary: README, false-alarm table)."""
NORM_MIN_NUMEL = 64
"""Below this many elements a norm does not concentrate; only the max-abs bound applies."""
NORM_FLOOR_ULPS = 2.0
"""Norm-wise floor: an rms error of 2 ulps of the tensor's rms (a reference that happens to be
exact still leaves the sharded run its own final roundings)."""

KIND_ORDER = ("init", "forward", "loss", "input_grad", "grad", "param")


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def lp_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the reference's own error is measured in for a run in `dtype`."""
    return torch.float32 if dtype == torch.float64 else dtype


@dataclass(kw_only=True)
class TensorCheck:
    kind: str
    """'init' (sharded params before step 0 against the reference's), 'forward', 'loss',
    'input_grad', 'grad', or 'param' (after the optimizer step, against that step applied in
    float64 to the sharded run's own params, grads and state: see harness.optim_ref)."""
    name: str
    """Reference tensor name ('output', 'loss', 'input', or a parameter name)."""
    step: int
    rank: int
    max_abs: float
    """max |sharded - ref64| over the rank's piece."""
    max_rel: float
    """max_abs / scale."""
    allowed: float
    ratio: float
    """max_abs / allowed: <= 1 passes."""
    worst_index: tuple[int, ...]
    """Index in the full reference tensor where the error is largest."""
    got: float
    want: float
    ok: bool
    note: str = ""
    norm_ratio: float = 0.0
    """||got - ref64|| / its norm-wise bound (0 where the tensor is too small for one)."""

    def describe(self) -> str:
        where = f"[{', '.join(map(str, self.worst_index))}]" if self.worst_index else ""
        extra = f" ({self.note})" if self.note else ""
        if self.norm_ratio > 1 and self.norm_ratio >= self.max_abs / max(self.allowed, 1e-300):
            extra += f" (norm-wise: error norm {self.norm_ratio:.3g}x its bound over the whole piece)"
        return (f"step {self.step} {self.kind} {self.name}{where} rank {self.rank}: "
                f"got {self.got:.6g} want {self.want:.6g}, max abs err {self.max_abs:.3g} "
                f"(rel {self.max_rel:.3g}) > allowed {self.allowed:.3g} ({self.ratio:.3g}x){extra}")

    def sort_key(self):
        return (self.step, KIND_ORDER.index(self.kind), self.name, self.rank)


def check_tensor(*, kind: str, name: str, step: int, rank: int, got: torch.Tensor, ref64: torch.Tensor,
                 ref_lp: torch.Tensor, dtype: torch.dtype, offset: tuple[int, ...] = (),
                 ref_alt: torch.Tensor | None = None, extra_allowed: float = 0.0) -> TensorCheck:
    """Judge `got` (a rank's piece) against the float64 reference piece `ref64`.

    `ref_lp` is the same piece from the same-precision reference, `ref_alt` from the perturbed
    float64 reference (optional); `offset` is where the piece starts in the full tensor, so the
    reported index is a reference index. `extra_allowed` is an absolute allowance the caller
    derives from the computation (the loss's, propagated from its output's error).
    """
    if got is None:
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=float("inf"),
                           max_rel=float("inf"), allowed=0.0, ratio=float("inf"), worst_index=(),
                           got=float("nan"), want=float(ref64.abs().max()) if ref64.numel() else 0.0,
                           ok=bool(ref64.numel() == 0 or not ref64.any()), note="no gradient")
    if tuple(got.shape) != tuple(ref64.shape):
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=float("inf"),
                           max_rel=float("inf"), allowed=0.0, ratio=float("inf"), worst_index=(),
                           got=float("nan"), want=float("nan"), ok=False,
                           note=f"shape {tuple(got.shape)} != reference piece {tuple(ref64.shape)}")
    if ref64.numel() == 0:
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=0.0, max_rel=0.0,
                           allowed=0.0, ratio=0.0, worst_index=(), got=0.0, want=0.0, ok=True)
    got64 = got.detach().to(torch.float64)
    ref64 = ref64.detach().to(torch.float64)
    err = (got64 - ref64).abs()
    nonfinite = ~torch.isfinite(got64)
    if nonfinite.any():
        err = torch.where(nonfinite, torch.full_like(err, float("inf")), err)
    scale = float(ref64.abs().max())
    # the precision the reference ran in, not its result's dtype: a float32 output against a
    # float64 target promotes the loss to float64, and scaling that by eps32/eps64 would allow 1e7x
    lp = lp_dtype(dtype)
    ref_err = float((ref_lp.detach().to(torch.float64) - ref64).abs().max()) * (eps(dtype) / eps(lp))
    if ref_alt is not None:
        ref_err = max(ref_err, float((ref_alt.detach().to(torch.float64) - ref64).abs().max()))
    allowed = FACTOR * ref_err + FLOOR_ULPS * eps(dtype) * max(scale, 1e-30) + extra_allowed
    norm_ratio = _norm_ratio(err, ref64, ref_lp, ref_alt, dtype, lp) if extra_allowed == 0 else 0.0
    flat = int(err.reshape(-1).argmax())
    max_abs = float(err.reshape(-1)[flat])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape)) if err.dim() else ()
    if offset:
        index = tuple(i + o for i, o in zip(index, offset, strict=True))
    ratio = max(max_abs / allowed if allowed else float("inf"), norm_ratio)
    return TensorCheck(
        kind=kind, name=name, step=step, rank=rank, max_abs=max_abs,
        max_rel=max_abs / scale if scale else max_abs, allowed=allowed, ratio=ratio, worst_index=index,
        got=float(got64.reshape(-1)[flat]), want=float(ref64.reshape(-1)[flat]),
        ok=ratio <= 1.0, norm_ratio=norm_ratio,
    )


def _norm_ratio(err: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, ref_alt: torch.Tensor | None,
                dtype: torch.dtype, lp: torch.dtype) -> float:
    """||err|| over the piece against NORM_FACTOR x the references' error norms (see NORM_FACTOR)."""
    n = err.numel()
    if n < NORM_MIN_NUMEL:
        return 0.0
    # the same-precision reference only: it runs the least accurate legal matmul order
    # (sidebyside._adversaries), while the perturbed one rounds every op's inputs and result
    # and so overstates a real kernel's error norm several times
    ref_norm = float((ref_lp.detach().to(torch.float64) - ref64).norm()) * (eps(dtype) / eps(lp))
    bound = NORM_FACTOR * ref_norm + NORM_FLOOR_ULPS * eps(dtype) * float(ref64.norm())
    got = float(err.norm())
    if got == 0:
        return 0.0
    return got / bound if bound else float("inf")


def check_bounded(*, kind: str, name: str, step: int, rank: int, got: torch.Tensor | None, want: torch.Tensor,
                  bound: torch.Tensor, offset: tuple[int, ...] = ()) -> TensorCheck:
    """Judge `got` against `want` element by element, each within its own `bound` (a rounding
    bound derived from the computation, e.g. harness.optim_ref). The reported ratio is the
    largest err / bound; `allowed` is the bound at that element."""
    want = want.detach().to(torch.float64)
    if got is None or tuple(got.shape) != tuple(want.shape):
        note = "missing" if got is None else f"shape {tuple(got.shape)} != expected {tuple(want.shape)}"
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=float("inf"), max_rel=float("inf"),
                           allowed=0.0, ratio=float("inf"), worst_index=(), got=float("nan"), want=float("nan"),
                           ok=False, note=note)
    if want.numel() == 0:
        return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=0.0, max_rel=0.0,
                           allowed=0.0, ratio=0.0, worst_index=(), got=0.0, want=0.0, ok=True)
    got64 = got.detach().to(torch.float64)
    err = (got64 - want).abs()
    err = torch.where(torch.isfinite(got64), err, torch.full_like(err, float("inf")))
    bound = bound.detach().to(torch.float64)
    # an exact expectation (bound 0) tolerates exactly 0 error
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    flat = int(ratio.reshape(-1).argmax())
    worst = float(ratio.reshape(-1)[flat])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape)) if err.dim() else ()
    if offset:
        index = tuple(i + o for i, o in zip(index, offset, strict=True))
    scale = float(want.abs().max())
    max_abs = float(err.max())
    return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=max_abs,
                       max_rel=max_abs / scale if scale else max_abs, allowed=float(bound.reshape(-1)[flat]),
                       ratio=worst, worst_index=index, got=float(got64.reshape(-1)[flat]),
                       want=float(want.reshape(-1)[flat]), ok=worst <= 1.0)
