"""How many significant digits a config's grads have at a dtype: perturb the float64 reference's
weights by one rounding of that dtype (each element times 1 + U(-u, u), u its unit roundoff),
recompute the step-0 grads in float64, and print, per param, how far they moved as a fraction
of their norm (median, 90th percentile and largest over the draws).

A piece whose grads move by their own norm under one rounding has no significant digits in that
dtype: a correct run lands anywhere in that spread, and two same-precision references cannot
bound where (docs/false-alarms.md, "The false alarms found, and what closed each": a bfloat16
ulysses-gpt draw whose pos_emb grads moved 1.0x their norm at the median, 7.0x at the 90th
percentile and 13.2x at the largest of 200 draws, and whose sharded run erred 17x).

    python tests/demo/rounding_sensitivity.py --case CASE [check's config flags] [--draws N]

Grads that are zero in exact arithmetic (an attention's k-proj bias: softmax's shift invariance)
move by many times their tiny norm in every config; in bfloat16 their bounds would pass a zero
tensor, and the tolerance model does not judge them (tolerance.vacuous). The default bfloat16 megatron-gpt-sp config's
other grads move by 2-3% at the median (50 draws).

Takes `sp-harness check`'s config flags (the repro line of a record) and runs no ranks; the
loss is the case's own token-loss sum over the reference's global batch at step 0.
"""

import argparse
import copy

import torch

from sp_harness.cli import add_config_args, config_from_args
from sp_harness.compare.tolerance import eps
from sp_harness.config.case import as_batch
from sp_harness.config.registry import get_case
from sp_harness.step.inputs import batch_generator, call

parser = argparse.ArgumentParser()
add_config_args(parser)
parser.add_argument("--draws", type=int, default=100)
parser.add_argument("--top", type=int, default=12, help="params printed, most sensitive first")
args = parser.parse_args()
config = config_from_args(args)
case = get_case(config.case)
config = case.resolve(config)
model = case.build_reference(config)
batch = as_batch(case.make_batch(config, 0, batch_generator(config.seed)))
unit = eps(config.torch_dtype) / 2


def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    m.zero_grad()
    out = call(m, batch.inputs, batch.positional)
    case.loss_sum(out, batch.target).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


exact = grads(model)
gen = torch.Generator().manual_seed(0)
moved: dict[str, list[float]] = {n: [] for n in exact}
for _ in range(args.draws):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1 + (torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2 - 1) * unit)
    for n, g in grads(m).items():
        norm = float(exact[n].norm())
        if norm > 0:
            moved[n].append(float((g - exact[n]).norm()) / norm)
print(f"{config.case} {config.dtype}: step-0 grads moved by one rounding (u = {unit:.3g}), {args.draws} draws, "
      "as a fraction of their norm")
rows = sorted(((sorted(v), n) for n, v in moved.items() if v), key=lambda r: -r[0][len(r[0]) // 2])
for v, n in rows[:args.top]:
    print(f"  {n:<34} median {v[len(v) // 2]:.3g}  p90 {v[int(len(v) * 0.9)]:.3g}  largest {v[-1]:.3g}")
