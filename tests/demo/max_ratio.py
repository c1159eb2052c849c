"""The small-piece quantiles behind sp_harness.compare.tolerance.SMALL_PIECE_QUANTILE.

For a piece of n elements whose errors are independent normals of one scale in every rounding
process, the max-abs bound compares the worst element of the sharded run, max_i |X_i|, with the
larger of the two references' worst, max(max_i |Y1_i|, max_i |Y2_i|). With F the half-normal CDF
and f its density,

    P(ratio > q) = int_0^inf n F(x)^(n-1) f(x) F(x/q)^(2n) dx,

solved here for P = 1e-5 by bisection on a trapezoid rule (and checked against draws at 1e-3).

    python tests/demo/max_ratio.py
"""

import math

import torch


def tail(n: int, q: float, grid: torch.Tensor) -> float:
    """P(max of n |X| > q * max of 2n |Y|), X, Y independent unit normals."""
    half_normal_cdf = torch.special.erf(grid / math.sqrt(2))
    density = math.sqrt(2 / math.pi) * torch.exp(-grid * grid / 2)
    worst = n * half_normal_cdf ** (n - 1) * density
    return float(torch.trapezoid(worst * torch.special.erf(grid / q / math.sqrt(2)) ** (2 * n), grid))


def quantile(n: int, p: float, grid: torch.Tensor) -> float:
    lo, hi = 1.0, 1e4
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if tail(n, mid, grid) > p else (lo, mid)
    return hi


if __name__ == "__main__":
    grid = torch.linspace(0, 12, 400_001, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 4, 8, 16, 64):
        q3 = quantile(n, 1e-3, grid)
        x = torch.randn(1_000_000, n, generator=gen, dtype=torch.float64).abs().amax(1)
        y = torch.randn(1_000_000, 2 * n, generator=gen, dtype=torch.float64).abs().amax(1)
        drawn = float((x / y > q3).double().mean())
        print(f"n={n:<3} q(1-1e-5)={quantile(n, 1e-5, grid):.2f}  q(1-1e-3)={q3:.2f} (drawn past it: {drawn:.2e})")
