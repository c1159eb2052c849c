"""Stage: step. The perturbed reference's rounding model, pure and process-group free.

`RoundingNoise` runs the float64 reference as if each op had rounded at the run's precision, on
another platform's kernels: the backward-error view of sp_harness.compare.tolerance's `ref_alt`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from sp_harness.config.case import island_dtype
from sp_harness.step.adversary import one_dim_sum, order_error, sum_order_error
from sp_harness.step.modules import ModuleStack
from sp_harness.step.noise_pool import NoisePool


def perturb_(tensor: torch.Tensor, rel: float, gen: torch.Generator) -> torch.Tensor:
    """Multiply every element by (1 + u * rel), u uniform in [-1, 1]: a rounding-sized change."""
    noise = torch.rand(tensor.shape, generator=gen, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        return tensor.mul_(1 + rel * noise.to(tensor.device, tensor.dtype))


class RoundingNoise(TorchDispatchMode):
    """Rounding at the run's precision, simulated in float64 over the perturbed reference's
    forward and backward: every floating-point op sees its tensor inputs and returns its result
    each multiplied by (1 + u * rel), u uniform in [-1, 1], and every matmul also gets the error
    of a random summation order (sp_harness.step.adversary.order_error): what a legal kernel on another
    platform may do, which the same-precision reference on this CPU does not show.

    The output noise is the standard model fl(op(x)) = op(x)(1 + d): a sharded run composes the
    same math from other ops (split matmuls, a bias added after a reduction) and so rounds other
    intermediates. The input noise is the backward-error model of a fused kernel, op(x + dx): a
    kernel that works internally at low precision (a LayerNorm backward whose result is a near
    cancellation, found by the nightly run) errs by the op's conditioning times eps. Views and
    in-place ops are left alone, so aliasing semantics hold.

    Precision islands: a tensor of a dtype coarser than the run's (a float32 cross-entropy in a
    float64 run) is rounded at its own dtype's eps (`_island_factor`), and a matmul of such
    tensors errs at its accumulator's (float32's): the op computed there, and a cast down to it
    (aten._to_copy) is itself a rounding at that eps. That error propagates, so the bounds grow
    only where the island's effect reaches. `islands(model, declared)` does the same for modules
    the case declares (a fused kernel's internal precision, which no dtype here shows). Without
    either, every draw is what it was before islands were modelled."""

    def __init__(self, rel: float, gen: torch.Generator, accumulate_rel: float | None = None,
                 matmul_input_rel: float | None = None, magnitude_dtype: torch.dtype | None = None,
                 walk: bool = True):
        super().__init__()
        self.walk = walk
        """The worst-order walk as the matmuls' order error (sp_harness.step.precision.Precision.walk);
        without it, the sequential model on matmuls and one-dim sums."""
        self.magnitude_dtype = magnitude_dtype
        """The dtype of order_error's |A| @ |B| (see there): float32 when the run's is at most that."""
        self.rel, self.gen = rel, gen
        self._pool: NoisePool | None = None
        self.accumulate_rel = rel if accumulate_rel is None else accumulate_rel
        """Unit roundoff x 2 of a matmul's accumulator: float32's for bfloat16 runs."""
        self.matmul_input_rel = rel if matmul_input_rel is None else matmul_input_rel
        """Relative rounding of a matmul's inputs: TF32's 2**-10 where the platform uses it."""
        self._order_scales: dict[int, tuple[torch.Tensor, float, tuple | None]] = {}
        """Recent matmul results' order-error magnitudes, by the result's storage (and the
        storages of reshapes of it): what softmax's backward needs to know about its grad."""
        self._salt: float | None = None
        """The row-sign hash's salt (`_row_sign`), drawn on first use."""
        self.within_range = False
        """Keep every perturbed value finite (`_within_range`): set for the rest of a check once a
        perturbed pass came out non-finite (sp_harness.checks.references.References.compute), so
        that other passes pay nothing for it."""
        self._coarse = coarser_dtypes(rel)
        """Dtype -> the eps a tensor of it rounds at as a precision island: the floating dtypes
        coarser than the run's, each at its own eps; inside a declared island, every one."""

    @property
    def pool(self) -> NoisePool:
        """Made on first use: every rank builds the references, only the owner runs this one."""
        if self._pool is None:
            self._pool = NoisePool(self.gen)
        return self._pool

    def _noisy(self, t, rel: float | None = None):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            rel = self.rel if rel is None else rel
            island = self._coarse.get(t.dtype)
            if island is not None and island > rel:
                return t * self._island_factor(t, island)
            # t (1 + rel u), a product so that infinities (masked scores) stay infinities (an
            # addcmul t + rel t u would turn -inf into nan); the window may be a view of the
            # pool's factors: never written to
            factor = self.pool.factor_window(t.shape, t.dtype, t.device, rel)
            return _within_range(t, factor, rel) if self.within_range else t * factor
        return t

    def _noisy_in_place(self, t: torch.Tensor) -> torch.Tensor:
        """`_noisy` for a result no one else holds: the same values, without a new tensor."""
        island = self._coarse.get(t.dtype)
        if island is not None and island > self.rel:
            return t.mul_(self._island_factor(t, island))
        factor = self.pool.factor_window(t.shape, t.dtype, t.device, self.rel)
        return _within_range(t, factor, self.rel) if self.within_range else t.mul_(factor)

    def _island_factor(self, t: torch.Tensor, eps: float) -> torch.Tensor:
        """(1 +- eps), a random sign per element: a rounding inside a precision island at its
        magnitude, not scaled by a uniform draw (as softmax backward's row-sum error). In float32
        a uniform 1 + u eps32 rounds to exactly 1 for a third of the draws, and an island's
        scalar (a float32 loss) is one draw: island-lm's loss came within 0.91x of its bound so."""
        return self.pool.window(t.shape, t.dtype, t.device).sign().mul_(eps).add_(1)

    @contextlib.contextmanager
    def islands(self, model: nn.Module, declared: Mapping[str, str]):
        """Within it, the ops of `model`'s modules named by a prefix in `declared` (module-name
        prefix -> dtype name, `Case.precision_islands`) round at that dtype's eps whatever their
        tensors' dtype, forward and backward (sp_harness.step.modules.ModuleStack), and their
        matmuls accumulate at float32's. Nothing is hooked when none is declared."""
        if not declared:
            yield
            return
        eps_of = {prefix: torch.finfo(island_dtype(name)).eps for prefix, name in declared.items()}
        run_islands = self._coarse

        def island_eps(name: str) -> float:
            return max((e for p, e in eps_of.items() if _within(name, p)), default=0.0)

        def on_change() -> None:
            eps = max((island_eps(n) for n in stack.active), default=0.0)
            self._coarse = coarser_dtypes(self.rel, eps) if eps > self.rel else run_islands

        stack = ModuleStack(model, lambda name: island_eps(name) > 0, on_change)
        try:
            with stack:
                yield
        finally:
            self._coarse = run_islands

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _passes_through(func):
            return func(*args, **(kwargs or {}))
        # looked up before the inputs are noised (a noised input is a new tensor)
        known = (self._order_scales.get(_ptr(args[0]))
                 if func is _SOFTMAX_BACKWARD or func in _RESHAPES else None)
        if func in _MATMULS and self.matmul_input_rel != self.rel:
            args = tuple(self._noisy(a, self.matmul_input_rel) for a in args)
        else:
            args = tuple(self._noisy(a) for a in args)
        out = func(*args, **(kwargs or {}))
        if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel()):
            return out
        # a result that shares no storage with the op's inputs is this call's alone: perturbed
        # in place (the same values as out of place, without a new tensor per op); one that does
        # (_unsafe_view declares no alias but is one) is left for whoever holds the input
        fresh = out.untyped_storage().data_ptr() not in _storages((*args, *(kwargs or {}).values()))
        if func is _SOFTMAX_BACKWARD:
            error = self._rowsum_error(*args[:3], known=known)
            out = out.add_(error) if fresh else out + error
        if func in _RESHAPES and known is not None and known[0].numel() == out.numel():
            self._remember(out, *known)
        # a matmul's reduction order is the kernel's choice: add the error of a random order
        if func in _MATMULS:
            a, b = args[-2], args[-1]
            op = torch.bmm if func is torch.ops.aten.bmm.default else torch.mm
            u, scale = self.accumulate_rel / 2, []
            if a.dtype in self._coarse:  # an island's matmul: float32's accumulator (bfloat16's too)
                u = max(self.accumulate_rel, _EPS32) / 2
            walk = self.walk or self._inputs_coarser
            if fresh:
                out = order_error(a, b, op, self.gen, u, pool=self.pool, magnitude_dtype=self.magnitude_dtype, into=out,
                                  scale_out=scale, walk=walk)
            else:
                out = out + order_error(a, b, op, self.gen, u, pool=self.pool, magnitude_dtype=self.magnitude_dtype,
                                        scale_out=scale, walk=walk)
            out = self._noisy_in_place(out) if fresh else self._noisy(out)
            # under the sequential model the magnitude no longer holds |a| @ |b|, which softmax's
            # backward may need (_rowsum_error): the operands, for that one matmul
            self._remember(out, scale[0], u * a.shape[-1] ** 0.5, None if walk else (a, b, op))
            return out
        if func is _SUM and not (self.walk or self._inputs_coarser) and one_dim_sum(args, kwargs or {}):
            # as a matmul's (sp_harness.step.adversary.sum_order_error says why)
            error = sum_order_error(args[0], args[1][0], self.gen, self.accumulate_rel / 2, pool=self.pool,
                                    magnitude_dtype=self.magnitude_dtype).reshape(out.shape)
            out = out.add_(error) if fresh else out + error
        return self._noisy_in_place(out) if fresh else self._noisy(out)

    @property
    def _inputs_coarser(self) -> bool:
        """Whether a matmul's inputs round coarser than its accumulator (bfloat16 products summed
        in float32, TF32 inputs): then softmax's backward needs |dO| @ |V^T| (`_rowsum_error`),
        which the walk order error (order_error's `walk`) computes, and the accumulator's u it
        overstates is far below the inputs' rounding."""
        return self.accumulate_rel < self.rel or self.matmul_input_rel > self.rel

    def _remember(self, result: torch.Tensor, scale: torch.Tensor, order_rel: float,
                  operands: tuple | None = None) -> None:
        """`scale`: the order error's magnitude for the matmul that produced `result`; where
        `_inputs_coarser`, order_rel x |a| @ |b|. `operands` (a, b, op): where the magnitude is
        the sequential model's, for |a| @ |b| on demand (`_rowsum_error`)."""
        # the last few only: a softmax backward follows its grad's matmul within a reshape or two
        self._order_scales[_ptr(result)] = (scale, order_rel, operands)
        while len(self._order_scales) > MAX_REMEMBERED:
            self._order_scales.pop(next(iter(self._order_scales)))


    def _rowsum_error(self, grad: torch.Tensor, prob: torch.Tensor, dim: int,
                      known: tuple[torch.Tensor, float, tuple | None] | None = None) -> torch.Tensor:
        """Softmax backward is p (g - D) with D = sum_j p_j g_j. The reference forms D from the
        same g it subtracts it from, so where the two cancel (one key: p = 1, an exact 0) every
        reference is exact. FlashAttention-style kernels (a ring's blocks among them) form D as
        rowsum(dO * O) from the forward's output instead, through other matmuls whose inputs are
        rounded at the platform's matmul precision (TF32 on GPUs): D then errs by about
        matmul_input_rel * sum_j p_j |g_j| and p (g - D) by p times that (at least the run's
        eps: the same sum in another order). Found by hypothesis: ring-gpt at seq_len 1, a k-bias
        grad of 1e-6 under reorder-tf32 (float32) and of 1.8e-18 under reorder (float64) where
        every reference gave exactly 0; it also closes a structurally-zero k-bias false alarm
        of the first campaign (megatron-gpt-tp, 3.2x before, 0.15 with it; docs/false-alarms.md). D is another dot
        product over the head dim than the dP it cancels against, so it also carries its own
        summation-order error, of the magnitude the reference gave dP's matmul (tracked from that
        matmul through reshapes): the campaign found seq_len-1 usp-gpt / ring-gpt runs at up to
        9x without it. Where the matmul's inputs are coarser than its accumulator (bfloat16
        products summed in float32, TF32 inputs), D and dP may also read dO rounded differently:
        a ring merges in float32 and rounds each block's dO to bfloat16 for its dP matmul while
        D = dO . O reads the float32 one, so g - D errs by rel x sum_i |dO_i v_i| however much
        dO . v cancels; that magnitude is rel x (|dO| @ |V^T|), from the same tracked matmul.
        Found by the campaign: a one-key bfloat16 ring's k-bias grad (zero in exact arithmetic)
        at 1.75x its max-abs bound."""
        rel, coarse = self.matmul_input_rel, self._coarse.get(prob.dtype)
        if coarse is not None and coarse > rel:
            rel = coarse
        scale = (prob * grad).abs().sum(dim, keepdim=True) * rel
        if known is not None and known[0].numel() == grad.numel():
            # g came out of a matmul dO @ V^T whose summation-order error the reference gave it;
            # a flash kernel's D = dO . O is another dot product over the same head dim, with an
            # error of its own of at most sum_j p_j u sqrt(d) |dO| . |v_j|: the same magnitudes
            magnitude, order_rel, operands = known
            factor = 1.0
            if self._inputs_coarser:
                factor += rel / order_rel  # dO rounded apart: rel x |dO| @ |V^T|
            scale = scale + factor * (prob * magnitude.reshape(grad.shape).to(prob.dtype)).sum(dim, keepdim=True)
            if operands is not None:
                # the sequential model's magnitude is not |dO| @ |V^T|. D = dO . O reads the
                # forward's output, rounded at least once at the run's eps per element (more
                # through a ring's merges) where dP = dO @ V^T reads V: D errs by up to
                # rel x sum_i |dO_i| |O_i| <= rel x sum_j p_j (|dO| @ |V^T|)_j, however much
                # dO . O cancels. The walk's magnitude, u sqrt(K) |dO| @ |V^T|, held this
                a, b, op = operands
                rounded_o = op(a.abs(), b.abs()).reshape(grad.shape).to(prob.dtype).mul_(rel)
                scale = scale + (prob * rounded_o).sum(dim, keepdim=True)
        # at its magnitude with a random sign, not scaled by a uniform draw: on an exact
        # cancellation this is the one error the tensor has, and a uniform factor near 0 (one
        # draw in 16 below 1/16) left the bound under the sharded run's single error by luck
        return prob * scale * self._row_sign(grad, prob, dim)

    def _row_sign(self, grad: torch.Tensor, prob: torch.Tensor, dim: int) -> torch.Tensor:
        """+-1 per softmax row, keyed on the row's values (its grad and probabilities) rather than
        drawn per row: a kernel is deterministic, so rows computed from the same values err
        alike. Drawn per row, two identical rows of a batch (two DP replicas' identical
        one-token sequences: usp-gpt, 4 ranks, dp 2, seq_len 1, reorder-tf32) drew opposite signs
        half the time, and their row-sum errors cancelled in the batch's k-bias grad where the
        sharded run's, one per replica, added up: 7.5x its max-abs bound. The key's hash (the
        fractional part of a large multiple of its sine) is salted once per reference, so other
        seeds draw other signs."""
        if self._salt is None:
            self._salt = float(self.pool.window(torch.Size([1]), torch.float64, torch.device("cpu"))[0])
        # keyed on the values at bfloat16's precision: this reference perturbs every op's inputs
        # (at eps), which would tell apart rows that the sharded run computes from equal values
        g64, p64 = (t.detach().to(torch.bfloat16).to(torch.float64) for t in (grad, prob))
        key = (g64 * p64).sum(dim, keepdim=True) + g64.square().sum(dim, keepdim=True) + p64.square().sum(dim, keepdim=True)
        hashed = torch.frac(torch.sin(key * 12.9898 + self._salt).abs() * 43758.5453)
        return torch.where(hashed < 0.5, -1.0, 1.0).to(prob.dtype)


_EPS32 = torch.finfo(torch.float32).eps
_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
             *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, n)))


class RoundedResults(TorchDispatchMode):
    """Every op's floating result rounded to `dtype` (round to nearest even), in a model that runs
    at a finer precision: the least accurate legal kernel choice, every intermediate materialised
    in the run dtype (attention scores and probabilities, a blockwise attention's partial
    outputs, each backward op's result), where the same-precision reference on this CPU keeps
    some of them in float32 inside fused kernels. One member of the ensemble
    (sp_harness.checks.references.SAMPLES). Views and in-place ops pass through (aliasing).

    Softmax's backward is p (g - D), D the row sum of p g. An explicit softmax forms D from the
    g it subtracts it from; a FlashAttention-style kernel (a ring's blockwise backward among
    them) forms D = rowsum(dO * O) from the forward's rounded output O instead, which breaks that
    cancellation by the roundings of O and of g: on a key grad, a sum over queries whose exact
    part cancels (softmax's shift invariance), that error is most of what a correct bf16 ring
    errs by (13% of a k-proj grad's norm at hidden 256, seq 512). Where the model's attention is
    an explicit softmax followed by a matmul with V, this member forms D the flash way, from the
    P @ V result it rounded and the dO of the matmul that produced g: the other legal choice than
    the run-precision reference's."""

    def __init__(self, dtype: torch.dtype, gen: torch.Generator | None = None):
        super().__init__()
        self.dtype = dtype
        self.gen = gen
        """Draws the rounding of the dO a flash row sum reads (None: no flash row sum)."""
        self._softmax_out: dict[int, None] = {}
        """Storages of recent softmax results (the P of P @ V)."""
        self._attn_out: dict[int, torch.Tensor] = {}
        """P's storage -> its P @ V result as rounded (O), for D = rowsum(dO * O) in backward."""
        self._grad_of: dict[int, torch.Tensor] = {}
        """A recent matmul result's storage (and its reshapes') -> its first operand: for the
        g = dO @ V^T that reaches softmax's backward, dO."""

    def _round(self, out, args, kwargs):
        if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel()
                and torch.finfo(out.dtype).bits > torch.finfo(self.dtype).bits):
            return out
        if out.untyped_storage().data_ptr() not in _storages((*args, *kwargs.values())):
            return out.copy_(out.to(self.dtype))  # this call's own result: no new tensor
        return out.to(self.dtype).to(out.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SOFTMAX_BACKWARD and self.gen is not None:
            flash = self._flash_softmax_backward(*args[:3])
            if flash is not None:
                return self._round(flash, (), {})
        out = func(*args, **kwargs)
        if _passes_through(func):
            return out
        if isinstance(out, (tuple, list)):
            return type(out)(self._round(o, args, kwargs) for o in out)
        out = self._round(out, args, kwargs)
        self._track(func, args, out)
        return out

    def _track(self, func, args, out) -> None:
        if func is _SOFTMAX:
            _remember(self._softmax_out, _ptr(out), None)
        elif func in _MATMULS[:2] and isinstance(out, torch.Tensor):
            first = args[0]
            if func is torch.ops.aten.bmm.default and _ptr(first) in self._softmax_out:
                # the forward's P @ V comes first; backward's P^T @ dO reads the same storage
                self._attn_out.setdefault(_ptr(first), out)
            _remember(self._grad_of, _ptr(out), first)
        elif func in _RESHAPES and isinstance(out, torch.Tensor) and _ptr(args[0]) in self._grad_of:
            _remember(self._grad_of, _ptr(out), self._grad_of[_ptr(args[0])])

    def _flash_softmax_backward(self, grad: torch.Tensor, prob: torch.Tensor, dim: int) -> torch.Tensor | None:
        """p (g - rowsum(dO * O)), where g came out of dO @ V^T and p's P @ V was O; None where
        the model's attention is not that shape (another reference's softmax keeps its own D)."""
        attn_out, d_out = self._attn_out.get(_ptr(prob)), self._grad_of.get(_ptr(grad))
        if attn_out is None or d_out is None or tuple(attn_out.shape) != tuple(d_out.shape):
            return None
        if dim not in (-1, prob.dim() - 1) or attn_out.numel() // attn_out.shape[-1] != prob.numel() // prob.shape[-1]:
            return None
        # a kernel's own float32 arithmetic: no mode below this one splits or rounds it
        with _disable_current_modes():
            # the dO D reads is rounded apart from the one g came from (a ring rounds each block's
            # share of dO to the run dtype for its dP matmul; D reads the float32 one): a rounding
            # drawn at the run dtype's unit roundoff
            u = torch.finfo(self.dtype).eps / 2
            drawn = torch.rand(d_out.shape, generator=self.gen, dtype=torch.float64).to(d_out.device, prob.dtype)
            d_out = d_out.to(prob.dtype) * (1 + u * (2 * drawn - 1))
            rowsum = (d_out * attn_out.to(prob.dtype)).sum(-1)  # one per query row
            return prob * (grad - rowsum.reshape(*prob.shape[:-1], 1))


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _remember(table: dict, key: int, value) -> None:
    """Keep the last MAX_REMEMBERED entries of `table`."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_REMEMBERED:
        table.pop(next(iter(table)))


def coarser_dtypes(rel: float, floor: float = 0.0) -> dict[torch.dtype, float]:
    """Floating dtypes that round above `rel` (the run's eps), with the eps they round at: their
    own, or `floor` (a declared island's) where that is larger."""
    found = {d: max(torch.finfo(d).eps, floor) for d in _FLOATING}
    return {d: e for d, e in found.items() if e > rel}


def _within(name: str, prefix: str) -> bool:
    """Whether module `name` is `prefix` or inside it (dotted components, '' the whole model)."""
    return not prefix or name == prefix or name.startswith(prefix + ".")


_SOFTMAX_BACKWARD = torch.ops.aten._softmax_backward_data.default
_SOFTMAX = torch.ops.aten._softmax.default
_RESHAPES = (torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default, torch.ops.aten.view.default,
             torch.ops.aten.reshape.default)
MAX_REMEMBERED = 4
"""Matmul results whose order-error magnitude is kept for a following softmax backward."""
_SUM = torch.ops.aten.sum.dim_IntList
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


def _storages(args) -> set[int]:
    """Data pointers of the storages of every tensor among an op's args (lists included)."""
    found = set()
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                found.add(t.untyped_storage().data_ptr())
    return found


def _within_range(t: torch.Tensor, factor: torch.Tensor, rel: float) -> torch.Tensor:
    """t x factor, except that an element within the factor of its dtype's largest finite value
    keeps its exact value: no rounding makes a finite value infinite. Such an element is a
    sentinel, a mask's finfo(float64).min: transformers 4.46.3's Qwen2 fills a padded query's row
    with it, and the perturbed row, -inf throughout, made the softmax NaN (the loss's bound NaN).
    Three more ops per tensor (the pass took 1.41x as long on a tiny Llama), hence only where a
    pass needs it (`RoundingNoise.within_range`)."""
    limit = torch.finfo(t.dtype).max / (1 + rel)
    return torch.where(t.abs() > limit, t, t * factor)


@functools.cache
def _passes_through(func) -> bool:
    """Views and in-place ops are left alone (aliasing semantics); cached per op, as reading the
    schema on every call cost as much as the rest of the dispatch."""
    schema = func._schema
    return schema.is_mutable or any(r.alias_info is not None for r in schema.returns)
