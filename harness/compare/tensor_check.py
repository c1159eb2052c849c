"""Stage: compare. One judged tensor (`TensorCheck`: a rank's piece against its float64
reference, with the bound it was held to and why) and the elementwise judgement against a
derived bound (`check_bounded`: a param after the optimizer step, the init, a grad norm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sp_harness.compare.update_scale import ScaleBound

KIND_ORDER = ("init", "forward", "lse", "loss", "input_grad", "grad", "grad_norm", "clip", "param")



@dataclass(kw_only=True)
class TensorCheck:
    kind: str
    """'init' (sharded params before step 0 against the reference's), 'forward', 'lse' (an
    attention module's per-query log-sum-exp, where the sharded one exposes it), 'loss',
    'input_grad', 'grad', or 'param' (after the optimizer step, against that step applied in
    float64 to the sharded run's own params, grads and state: see sp_harness.step.optim_ref)."""
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
    """The whole piece's ratio (0 where the piece is too small for one): ||got - ref64|| / its
    norm-wise bound, or for a parameter below float32 after the step its coherent update scale /
    that scale's bound (sp_harness.compare.update_scale)."""
    err_norm: float = 0.0
    """||got - ref64|| over the piece (where a norm-wise bound applies)."""
    noise_norm: float = 0.0
    """The references' error norm the norm-wise bound scales: the ensemble's largest where it
    judges (ENSEMBLE_KINDS, runs below float32), else the larger of the run-precision and
    perturbed references'."""
    ref_norm: float = 0.0
    """||ref64|| over the piece (where a norm-wise bound applies)."""
    dof: float = 0.0
    """The degrees of freedom m the ensemble's factor F(m) counted for the piece (0 where the
    ensemble did not judge it): tokens, their participation, or a Linear grad's derived ones."""
    scale_ratio: float = 0.0
    """A low-precision piece's coherent scale along its exact value / that scale's bound (0 where
    none was computed). A forward output's is judged (part of `ratio`;
    sp_harness.compare.output_scale); a Linear or norm weight grad's is recorded, not judged:
    correct runs' attention key projections exceed its model (sp_harness.compare.grad_scale)."""
    scale: float = 0.0
    """That coherent scale, beta: the piece is (1 + beta) times the exact one plus noise."""
    vacuous: float = 0.0
    """Where the piece's bounds would pass a zero tensor (sp_harness.compare.tolerance.vacuous):
    the smaller bound over the piece's own size, >= 1; the piece is then not judged (ratio 0,
    ok) unless the run is not finite there. 0: judged."""
    withheld_ratio: float = 0.0
    """Where the piece is not judged (`vacuous`): the ratio its bounds would have given it.
    Recorded, never judged: the evidence for judging a class of withheld pieces again (an
    attention's k-proj bias grad, zero in exact arithmetic) comes from it."""

    def describe(self) -> str:
        where = f"[{', '.join(map(str, self.worst_index))}]" if self.worst_index else ""
        extra = f" ({self.note})" if self.note else ""
        if self.kind != "param" and self.norm_ratio > 1 and self.norm_ratio >= self.max_abs / max(self.allowed, 1e-300):
            counted = f", {self.dof:.3g} degrees of freedom" if self.dof else ""
            extra += f" (norm-wise: error norm {self.norm_ratio:.3g}x its bound over the whole piece{counted})"
        if self.kind == "forward" and self.scale_ratio > 1 and self.scale_ratio >= self.max_abs / max(self.allowed, 1e-300):
            sign = "+" if self.scale >= 0 else "-"
            extra += (f" (coherent scale: the piece is (1 {sign} {abs(self.scale):.3g}) x the exact one, "
                      f"{self.scale_ratio:.3g}x the band correct runs span)")
        if self.kind == "param" and self.ratio <= 1 < self.norm_ratio:
            return (f"step {self.step} {self.kind} {self.name} rank {self.rank}: {self.note}, "
                    f"{self.norm_ratio:.3g}x its bound over the whole piece (every element within its own "
                    f"bound, the worst at {self.ratio:.3g}x)")
        # a piece failed norm-wise or by its scale may have every element inside the max-abs bound
        elementwise = self.max_abs / self.allowed if self.allowed else float("inf")
        return (f"step {self.step} {self.kind} {self.name}{where} rank {self.rank}: "
                f"got {self.got:.6g} want {self.want:.6g}, max abs err {self.max_abs:.3g} "
                f"(rel {self.max_rel:.3g}) {'>' if elementwise > 1 else '<='} allowed {self.allowed:.3g} "
                f"({elementwise:.3g}x){extra}")

    def sort_key(self):
        return (self.step, KIND_ORDER.index(self.kind), self.name, self.rank)


def check_bounded(*, kind: str, name: str, step: int, rank: int, got: torch.Tensor | None, want: torch.Tensor,
                  bound: torch.Tensor, offset: tuple[int, ...] = (), scale: ScaleBound | None = None) -> TensorCheck:
    """Judge `got` against `want` element by element, each within its own `bound` (a rounding
    bound derived from the computation, e.g. sp_harness.step.optim_ref). The reported ratio is the
    largest err / bound; `allowed` is the bound at that element. `scale`: a low-precision
    update's coherent scale against its bound (sp_harness.compare.update_scale), judged over the
    whole piece as its `norm_ratio`."""
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
    magnitude = float(want.abs().max())
    max_abs = float(err.max())
    whole = 0.0 if scale is None else scale.ratio
    return TensorCheck(kind=kind, name=name, step=step, rank=rank, max_abs=max_abs,
                       max_rel=max_abs / magnitude if magnitude else max_abs, allowed=float(bound.reshape(-1)[flat]),
                       ratio=worst, worst_index=index, got=float(got64.reshape(-1)[flat]),
                       want=float(want.reshape(-1)[flat]), ok=worst <= 1.0 and whole <= 1.0,
                       norm_ratio=whole, note="" if scale is None or whole <= 1.0 else scale.describe())
