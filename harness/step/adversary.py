"""Stage: step. The reorder adversary: a correct run made to reduce in other legal orders.

A verdict must not depend on the order a CPU's or GPU's kernels happen to sum in. Rather than
wait for other machines, this dispatch mode makes the sharded side of a run reduce differently
on every call: each matmul (mm, addmm, bmm) is split along its reduction dim into randomly
sized chunks whose partial products are summed in a random order, plus the error of a random
summation order (`order_error`: the worst-order walk, float32's sequential model), and each
single-dim sum is split the same way (float32's with that model's error too). bfloat16 products accumulate in float32 and round once (what tensor cores
and oneDNN do); with `tf32=True` float32 matmul inputs are first rounded to TF32's 10-bit
mantissa, as on an Ampere+ GPU with `allow_tf32`. TF32 is a property of the platform, not of
the sharding, so the engine applies it to the same-precision reference too (a real platform
runs both there); the chunking and reordering stay on the sharded side only.

DTensor's own local kernels run with dispatch modes popped, so for DTensor cases only the
plain-tensor ops outside DTensor are reordered here. Beyond this mode, the pool's environment varies what it cannot: `ATEN_CPU_CAPABILITY`
(default / avx2 / avx512 kernels) and `OMP_NUM_THREADS` (intra-op split), see
tests/demo/false_alarms.py.
"""

from __future__ import annotations

import math
import struct
import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sp_harness.step.noise_pool import NoisePool
from sp_harness.step.precision import accumulator

aten = torch.ops.aten

MAX_CHUNKS = 8


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32 (10 explicit mantissa bits), round half away from zero."""
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view(x.shape)


ORDER_BLOCKS = 8
"""Blocks of the reduction dim whose natural-order prefix sums `order_error` follows: a kernel
that walks K in order carries each block's running total into the next, so a sum with a trend
along K (a grad whose tokens' terms drift with position) has larger partial sums than a random
order would give it."""
BLOCK_TERMS = 16
"""Terms per block at the least: fewer blocks than ORDER_BLOCKS for sums shorter than 128
terms (each block costs a pass or three over the result). The blocks must resolve the ranks'
contiguous shards of a token sum: at 128 terms per block a 137-token sum was one block, the
model 0.38x a naive loop's error where the sum's sign flips halfway (tests/test_tolerance_parts.py),
and a float32 usp-gpt campaign draw (3 ranks, 137 tokens, `--seed 870`, `avx2`) failed a
collapsed fc2 weight grad at 2.8x; at 16 it PASSes at 0.74."""


def order_error(a: torch.Tensor, b: torch.Tensor, op, gen: torch.Generator, u: float, pool=None,
                magnitude_dtype: torch.dtype | None = None, into: torch.Tensor | None = None,
                scale_out: list | None = None, walk: bool = True) -> torch.Tensor:
    """An error some legal summation order could make in op(a, b) at unit roundoff u.

    A K-term dot product summed one term at a time rounds each partial sum P_i (and each
    product t_i), an error sum_i d_i P_i + d'_i t_i with |d| <= u: independent roundings, so its
    root mean square is u / sqrt(3) x sqrt(sum_i P_i^2 + sum_i t_i^2). This returns
    u x sqrt(sum_i P_i^2 + sum_i t_i^2) x U(-1, 1) per element, whose rms is that: the error of a
    sequential kernel (a naive loop, split-K with atomics), less accurate than the blocked sums
    of this CPU's, so what a legal kernel on another platform may do. sum_i P_i^2 is taken in
    expectation over orders within each of ORDER_BLOCKS blocks of K walked in natural order:
    with S_b the block's sum and Q_b the total before it, a block of L terms contributes
    L (Q_b^2 + Q_b S_b + S_b^2 / 3) + L^2 sigma_b^2 / 6, the last term bounded here by
    K / 6 x sum_t t^2 (one matmul of squares) for every block at once. Where a sum cancels (a
    grad over tokens, a centred activation times a weight) the partial sums stay near sqrt(K)
    terms, not K: the earlier worst-over-orders walk, u sqrt(K) |a| @ |b|, exceeded this by
    sqrt(2K), 32x at 512 tokens, which set float32's sensitivity at the training size
    (docs/tolerance.md, "Order error").

    `walk` (the default; Precision.walk says for which runs): that earlier magnitude instead,
    u sqrt(K) |a| @ |b|. sp_harness.step.rounding.RoundingNoise also needs it where the matmul's
    inputs are coarser than its accumulator (its |a| @ |b| feeds the row-sum error, and the
    accumulator's u, which the walk overstates, is far below the inputs' rounding). u is the accumulator's: bfloat16 and float16 products
    accumulate in float32 on every real kernel.

    `magnitude_dtype` (float32 where a float64 pass simulates a run of float32 or less) is the
    dtype the magnitude is formed in: it is only an error's size, which float32's own rounding
    does not change, and a run of that precision cannot hold a value that would overflow
    float32. Half the matmul cost of float64 on a CPU. With `into` (a result this call may
    write), the error is added to it in place and `into` returned. `scale_out` gets the
    error's magnitude (before the random factor)."""
    converts = magnitude_dtype is not None and magnitude_dtype != a.dtype
    k = a.shape[-1]
    if walk:
        if converts:
            a_abs, b_abs = a.to(magnitude_dtype, copy=True).abs_(), b.to(magnitude_dtype, copy=True).abs_()
        else:
            a_abs, b_abs = a.abs(), b.abs()
        # the scalar rides on the smaller operand (the same product up to rounding, which an error
        # magnitude does not notice): a pass over an operand, not over a result that may be larger
        (a_abs if a_abs.numel() <= b_abs.numel() else b_abs).mul_(u * k ** 0.5)
        scale = op(a_abs, b_abs)
    else:
        a_m, b_m = (a.to(magnitude_dtype), b.to(magnitude_dtype)) if converts else (a, b)
        scale = _partial_sums_square(a_m, b_m, op).sqrt_().mul_(u)
    if pool is not None:  # sp_harness.step.noise_pool.NoisePool: windows of one buffer, not fresh draws
        noise = pool.window(scale.shape, a.dtype, scale.device)
    else:
        noise = torch.rand(scale.shape, generator=gen, dtype=torch.float64).to(a.dtype) * 2 - 1
    if scale_out is not None:
        scale_out.append(scale)
    if into is not None:  # added where it goes in one pass, a float32 magnitude promoted on the way
        return into.addcmul_(scale, noise)
    return scale.mul_(noise) if scale.dtype == noise.dtype and scale_out is None else torch.mul(scale, noise)


def _partial_sums_square(a: torch.Tensor, b: torch.Tensor, op) -> torch.Tensor:
    """sum_i P_i^2 + sum_i t_i^2 for op(a, b) over a's last dim (see order_error): the blocks'
    natural-order trend from their sums, the spread within them from one matmul of squares."""
    k = a.shape[-1]
    a_sq = a.square()
    a_sq.mul_(k / 6 + 1)  # the within-block spread, bounded for every block by the whole sum's
    total = op(a_sq, b.square())
    before = None
    # a block costs a pass or three over the result: as many as the sum is long, up to
    # ORDER_BLOCKS (a 16-term head-dim sum is one block, a 32-term one two, 128 terms or more eight)
    step = -(-k // max(1, min(ORDER_BLOCKS, k // BLOCK_TERMS))) if k else 1
    for lo in range(0, k, step):
        hi = min(lo + step, k)
        block = op(a[..., lo:hi], b[..., lo:hi, :])
        # L (Q^2 + Q S + S^2 / 3): the mean of P^2 along a line from Q to Q + S, times its L steps
        total.addcmul_(block, block, value=(hi - lo) / 3)
        if before is None:
            before = block
            continue
        after = before + block
        total.addcmul_(before, after, value=hi - lo)
        before = after
    return total


def sum_order_error(x: torch.Tensor, dim: int, gen: torch.Generator, u: float, pool=None,
                    magnitude_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sequential-order error (order_error with walk=False) of x.sum(dim), in the sum's
    shape without the dim: a sum is a product with ones. Where a sum cancels (a bias grad over
    tokens whose per-token terms share a large mean) its partial sums are far larger than its
    terms or its result, so neither the terms' rounding nor the result's shows this error. The
    walk on the matmuls upstream was large enough to cover it; the sequential model is not.
    Found by the float32 campaign with the sequential-order model on: a usp-gpt q-proj bias grad
    (3 ranks, 512 tokens, hidden 384, `--seed 65535`) erred 2.9x both references under the
    reorder adversary, which splits such sums (0.6x without the adversary)."""
    dim = dim % x.dim()
    terms = x.movedim(dim, -1)
    shape, k = terms.shape[:-1], x.shape[dim]
    ones = torch.ones(k, 1, dtype=x.dtype, device=x.device)
    # sized explicitly: a 0-token rank's sum has no terms (and reshape(-1, 0) is ambiguous)
    error = order_error(terms.reshape(math.prod(shape), k), ones, torch.mm, gen, u, pool=pool,
                        magnitude_dtype=magnitude_dtype, walk=False)
    return error.reshape(shape)


def one_dim_sum(args, kwargs) -> bool:
    """Whether aten.sum.dim_IntList's arguments sum over one dim in the input's own dtype: the
    sums the reorder adversary splits and the sequential model gives an order error."""
    return len(args) >= 2 and len(args[1] or ()) == 1 and "dtype" not in kwargs


class ReorderAdversary(TorchDispatchMode):
    """Random chunked, randomly ordered reductions for matmuls and sums (see module doc).

    The randomness is a function of `seed` and the op's inputs (their shapes and a checksum),
    never of the rank or of how many ops ran before: a platform's kernels are deterministic, so
    ranks that compute a replicated parameter's grad from the same inputs get the same bits, as
    Megatron-style TP relies on (with torch.use_deterministic_algorithms on GPU)."""

    def __init__(self, seed: int, *, reorder: bool = True, order_noise: bool = True, tf32: bool = False,
                 partials: int = 1, partial_dtype: torch.dtype | None = None, walk: bool = True):
        """`partials` > 1: every split reduction has at most that many parts, and each part is
        rounded to the op's dtype before the parts are summed in it: what a reduction split over
        that many ranks and summed by a collective in the run dtype does (a row-parallel
        matmul's reduce-scatter, a DP grad all-reduce). The ensemble references
        (sp_harness.checks.references.SAMPLES) run so, with the job's world size.
        `partial_dtype`: the dtype the parts are rounded to, where the model computes finer
        than the run dtype (default: the op's). `walk`: the order error's magnitude (Precision.walk)."""
        super().__init__()
        self.seed, self.reorder, self.tf32 = seed, reorder, tf32
        self.partials, self.partial_dtype = partials, partial_dtype
        self.order_noise, self.walk = order_noise, walk
        self.gen = torch.Generator()
        self.num_rewritten = 0
        self._pool = None

    @property
    def pool(self):
        """The order noise's uniform values (sp_harness.step.noise_pool.NoisePool), drawn once from
        `seed` alone so every rank holds the same; windows are picked by `gen`, which _reseed keys
        on the op's inputs. Fresh torch.rand for every element of every matmul cost a third of the
        run-precision reference. Made on first use: a rank that never reorders holds none."""
        if self._pool is None:
            # a quarter of the perturbed reference's pool: windows beyond it are cut from pieces
            self._pool = NoisePool(torch.Generator().manual_seed(self.seed), size=1 << 20, tail=1 << 18)
            self._pool.gen = self.gen
        return self._pool

    def _reseed(self, op: str, tensors) -> None:
        key = [op, self.seed]
        for t in tensors:
            # summed in float64 without a float64 copy of the tensor
            key += [tuple(t.shape), struct.pack("<d", float(t.detach().sum(dtype=torch.float64)))]
        self.gen.manual_seed(zlib.crc32(repr(key).encode()))
        if self._pool is not None:
            self._pool.forget_offsets()  # the order noise follows this op's seed, not earlier ops'

    def _cuts(self, n: int) -> list[int]:
        if not self.reorder or n < 2:
            return [n]
        most = MAX_CHUNKS if self.partials <= 1 else self.partials
        k = int(torch.randint(2, min(n, most) + 1, (), generator=self.gen))
        points = sorted(torch.randperm(n - 1, generator=self.gen)[: k - 1].add(1).tolist())
        return [b - a for a, b in zip([0] + points, points + [n], strict=True)]

    def _order(self, k: int) -> list[int]:
        return torch.randperm(k, generator=self.gen).tolist() if self.reorder else list(range(k))

    def _sum(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if self.partials > 1 and len(parts) > 1:
            # each rank's partial in the run dtype
            parts = [p.copy_(p.to(self.partial_dtype or dtype)) for p in parts]  # fresh results: in place
        order = self._order(len(parts))
        acc = parts[order[0]]
        for i in order[1:]:
            acc = acc.add_(parts[i])  # every part is a fresh result of this call: no copy needed
        return acc.to(dtype)

    def _matmul(self, a: torch.Tensor, b: torch.Tensor, op) -> torch.Tensor:
        """a @ b over a's last dim (b's dim -2), chunked and reordered, plus an order error."""
        dtype = a.dtype
        if self.tf32 and dtype == torch.float32:
            a, b = round_tf32(a), round_tf32(b)
        acc_dtype = accumulator(dtype)
        sizes = self._cuts(a.shape[-1])
        a_parts = a.split(sizes, dim=-1)
        b_parts = b.split(sizes, dim=-2)
        parts = [op(x.to(acc_dtype), y.to(acc_dtype)) for x, y in zip(a_parts, b_parts, strict=True)]
        if self.order_noise:
            parts.append(order_error(a.to(acc_dtype), b.to(acc_dtype), op, self.gen, torch.finfo(acc_dtype).eps / 2,
                                     pool=self.pool, walk=self.walk))
        return self._sum(parts, dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        plain = all(type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) for t in tensors)
        if not plain:
            # a tensor subclass (DTensor) runs its own local kernels with this mode popped, so
            # DTensor compute is not reordered here; the environment part (capability, threads)
            # still varies it
            return func(*args, **kwargs)
        floating = tensors and all(t.is_floating_point() for t in tensors)
        if floating and func in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.sum.dim_IntList):
            self._reseed(str(func), tensors)
        if floating and func is aten.mm.default and not kwargs:
            self.num_rewritten += 1
            return self._matmul(args[0], args[1], torch.mm)
        if floating and func is aten.bmm.default and not kwargs:
            self.num_rewritten += 1
            return self._matmul(args[0], args[1], torch.bmm)
        if floating and func is aten.addmm.default and len(args) == 3:
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            self.num_rewritten += 1
            prod = self._matmul(args[1], args[2], torch.mm)
            return beta * args[0] + alpha * prod if (beta, alpha) != (1, 1) else args[0] + prod
        if floating and func is aten.sum.dim_IntList and one_dim_sum(args, kwargs):
            dim = args[1][0]
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            x = args[0]
            sizes = self._cuts(x.shape[dim])
            acc_dtype = accumulator(x.dtype)
            if len(sizes) > 1:
                self.num_rewritten += 1
                parts = [p.to(acc_dtype).sum(dim, keepdim=keepdim) for p in x.split(sizes, dim=dim)]
                out = self._sum(parts, x.dtype)
            else:
                out = func(*args, **kwargs)
            if self.order_noise and not self.walk and out.numel():
                # as a matmul's: the order error of the sum a kernel takes (the walk's, on the
                # matmuls, covers sums too, so only the sequential model adds it)
                error = sum_order_error(x.to(acc_dtype), dim, self.gen, torch.finfo(acc_dtype).eps / 2, pool=self.pool)
                out = out + error.reshape(out.shape).to(out.dtype)
            return out
        return func(*args, **kwargs)
