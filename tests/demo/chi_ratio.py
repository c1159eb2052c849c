"""The chi-ratio quantiles behind sp_harness.compare.tolerance.CHI_RATIO_QUANTILE.

For m degrees of freedom, draw X and Y1..Yn chi-distributed (the norm of m independent unit
normal contributions) and print the 1 - 1e-5 quantile of X / max(Yk): how far one rounding
process's error norm exceeds the largest of an ensemble (two by default) once in 1e5 pieces.
With --pooled the ensemble's norms are pooled, sqrt(mean Yk^2), as a bound from many members
would pool them (docs/sensitivity.md, "How many members the missed targets need").

    python tests/demo/chi_ratio.py [--draws N] [--samples K] [--pooled]
"""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--draws", type=int, default=1_000_000)
parser.add_argument("--samples", type=int, default=2, help="ensemble size")
parser.add_argument("--pooled", action="store_true", help="divide by the members' pooled norm, not the largest")
args = parser.parse_args()
torch.manual_seed(0)
for m in (2, 3, 4, 6, 8, 16, 24, 32, 64, 256):
    chi = torch.distributions.Chi2(torch.tensor(float(m)))
    x = chi.sample((args.draws,)).sqrt()
    y2 = chi.sample((args.draws, args.samples))
    y = y2.mean(1).sqrt() if args.pooled else y2.sqrt().max(1).values
    r = (x / y).sort().values
    print(f"m={m:<4} q(1-1e-3)={float(r[int(args.draws * (1 - 1e-3))]):.3f} "
          f"q(1-1e-5)={float(r[int(args.draws * (1 - 1e-5))]):.3f} max={float(r[-1]):.3f}")
