"""Scaled mutants of megatron-gpt-sp: one number on one rank off by a relative d, d tunable.

Stage: config and step. They measure the harness's sensitivity (`sp-harness sensitivity` bisects
the smallest d each check catches, per dtype), they are not catalogue bugs: tagged "scaled",
which `sp_harness.suites.battery.mutant_names()` leaves out of the default battery.

Four shapes of bug, each `CORRECT` plus one wrapper, the first three on TP rank 1 only:

  mutant-scaled-forward  the logits TP rank 1 returns (its output piece of the final layer)
                         times (1 + d); the backward through them is scaled with them.
  mutant-scaled-grad     TP rank 1's grad of its shard of blocks.0.mlp.fc1.weight, after the
                         grad sync, times (1 + d).
  mutant-scaled-update   the optimizer update of that shard on TP rank 1 times (1 + d):
                         p_new <- p_old + (1 + d) (p_new - p_old), by a global optimizer
                         step pre/post hook pair (no engine change), filtered on the one param.
  mutant-scaled-norm-grad  every rank's grad of blocks.0.norm1.weight (a LayerNorm weight,
                         replicated, summed over the TP ranks) after the grad sync times
                         (1 + d): on every rank, because a replicated param's grad scaled on one
                         rank alone makes its replicas drift, which the replica check catches
                         at any d. A bias or norm grad of 16-32 elements: the piece bfloat16's
                         max-abs bound could not judge (docs/sensitivity.md).

d is read from the environment variable SP_HARNESS_SCALE_D when the sharded model is built
(`DEFAULT_D` if unset). Rank processes are persistent (sp_harness.launch.pool) and took the driver's
environment when their pool started, so a driver that changes d between checks calls
`set_scale(runner, d)`: it sets the driver's variable (for pools started later) and runs the
job `set_scale_job` on the ranks of the live pool. Every scaling is computed in float64 and cast
back, as `x + d * x`, so d = 0 leaves every value bit-identical: the d = 0 mutant is a correct
implementation and must PASS (no false alarm from the hook machinery itself).
"""

from __future__ import annotations

import os
import weakref

import torch

from sp_harness.cases.megatron.cases import SP
from sp_harness.cases.megatron.impl import CORRECT
from sp_harness.cases.megatron.model import build_sharded
from sp_harness.config.case import Case, Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant

ENV = "SP_HARNESS_SCALE_D"
DEFAULT_D = 1e-3
"""d when SP_HARNESS_SCALE_D is unset: a plain `sp-harness check` of a scaled mutant FAILs."""
TAGS = ("mutant", "scaled", "megatron")
BASE = "megatron-gpt-sp"
RANK = 1
"""The TP rank that carries the error."""
PARAM = "blocks.0.mlp.fc1.weight"
"""The parameter (local name = reference name) whose grad or update is scaled."""
NORM_PARAM = "blocks.0.norm1.weight"
"""The replicated norm weight whose grad mutant-scaled-norm-grad scales on every rank."""
SHAPES = ("forward", "grad", "update", "norm-grad")
EVERY_RANK = frozenset({"norm-grad"})
"""The shapes applied on every rank (a replicated param's), not on TP rank RANK alone."""


def scale_d() -> float:
    """This process's d: SP_HARNESS_SCALE_D, or DEFAULT_D."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_D
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{ENV} must be a number, got {text!r}") from None


def set_scale_job(d: float | None) -> float:
    """Rank-side job: set (None: unset) SP_HARNESS_SCALE_D in this rank process."""
    if d is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = repr(float(d))
    return scale_d()


def set_scale(runner, d: float | None, world_size: int = 2, timeout_s: float = 60.0) -> None:
    """Make the next checks of the scaled mutants on `runner` (a PoolManager, or TorchrunWorld)
    run with `d` (None: back to unset): in the driver's environment, inherited by pools started
    later, and on the live pool of `world_size` ranks (started if it is not)."""
    if d is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = repr(float(d))
    got = runner.run(world_size, set_scale_job, d, timeout_s=timeout_s,
                     label=f"set {ENV}={d!r}")
    want = scale_d()
    if any(g != want for g in got):
        raise RuntimeError(f"ranks read {ENV} as {got}, the driver as {want}")


def _scaled(x: torch.Tensor, d: float) -> torch.Tensor:
    """x + d * x computed in float64, in x's dtype (exactly x when d == 0); differentiable."""
    x64 = x.to(torch.float64)
    return (x64 + d * x64).to(x.dtype)


def _param(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    params = dict(module.named_parameters())
    if name not in params:
        raise RuntimeError(f"scaled mutant: the sharded model has no parameter {name!r}")
    return params[name]


# ----------------------------------------------------------------- the three bug shapes


def _scale_forward(sharded: Sharded, ctx: RankContext, d: float) -> None:
    def hook(module, args, output):
        return _scaled(output, d)

    sharded.module.register_forward_hook(hook)


def _scale_grad(sharded: Sharded, ctx: RankContext, d: float, name: str = PARAM) -> None:
    param = _param(sharded.module, name)
    sync = sharded.sync_grads

    def sync_then_scale() -> None:
        sync()
        if param.grad is not None:
            with torch.no_grad():
                param.grad.copy_(_scaled(param.grad, d))

    sharded.sync_grads = sync_then_scale


_HOOKS: list = []
"""Global optimizer hook handles of the last scaled-update model built in this process."""


def _remove_hooks() -> None:
    while _HOOKS:
        _HOOKS.pop().remove()


def _scale_update(sharded: Sharded, ctx: RankContext, d: float) -> None:
    """Global optimizer step hooks (the engine builds the optimizer after this factory returns):
    the pre hook keeps p_old, the post hook rewrites p_new = p_new + d (p_new - p_old). Both act
    only on an optimizer that holds this very parameter (held by weak reference), and are removed
    when it dies or the next scaled-update model is built, so a persistent rank process never
    carries them into another job."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _remove_hooks()
    ref = weakref.ref(_param(sharded.module, PARAM))
    before: dict[int, torch.Tensor] = {}

    def holds(opt) -> torch.nn.Parameter | None:
        p = ref()
        if p is None:
            return None
        return p if any(q is p for group in opt.param_groups for q in group["params"]) else None

    def pre(opt, args, kwargs) -> None:
        p = holds(opt)
        if p is not None:
            before[id(opt)] = p.detach().to(torch.float64).clone()

    def post(opt, args, kwargs) -> None:
        p = holds(opt)
        old = before.pop(id(opt), None)
        if p is None or old is None:
            return
        with torch.no_grad():
            new = p.detach().to(torch.float64)
            p.copy_((new + d * (new - old)).to(p.dtype))

    _HOOKS.extend([register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)])
    handles = list(_HOOKS)
    weakref.finalize(ref(), lambda: [h.remove() for h in handles])


def _scale_norm_grad(sharded: Sharded, ctx: RankContext, d: float) -> None:
    _scale_grad(sharded, ctx, d, NORM_PARAM)


_APPLY = {"forward": _scale_forward, "grad": _scale_grad, "update": _scale_update, "norm-grad": _scale_norm_grad}


def _shard(shape: str):
    apply = _APPLY[shape]

    def shard(ref: torch.nn.Module, ctx: RankContext) -> Sharded:
        d = scale_d()
        sharded = build_sharded(ref, ctx, CORRECT, sequence_parallel=True)
        if ctx.tp_rank == RANK or shape in EVERY_RANK:
            apply(sharded, ctx, d)  # also at d == 0: the machinery itself must not false-alarm
        return sharded

    return shard


def _scaled_mutant(shape: str, short: str, bug: str) -> Case:
    name = f"mutant-scaled-{shape}"
    return mutant(SP, name=name, summary=f"{short} ({ENV}, default {DEFAULT_D:g})", bug=bug, tags=("scaled",),
                  source="constructed: a bug of adjustable size d, for the sensitivity table", shard=_shard(shape))


FORWARD = _scaled_mutant(
    "forward",
    "TP rank 1's logits x (1 + d)",
    "sensitivity probe: TP rank 1's output piece of the final layer (the logits it returns) off by a "
    "relative d (a rank-local rounding or scaling error in the last layer)",
)
GRAD = _scaled_mutant(
    "grad",
    f"TP rank 1's {PARAM} grad x (1 + d)",
    f"sensitivity probe: TP rank 1's shard of the {PARAM} grad, after the grad sync, off by a relative d "
    "(a mis-scaled or partly reduced grad on one rank)",
)
UPDATE = _scaled_mutant(
    "update",
    f"TP rank 1's {PARAM} optimizer update x (1 + d)",
    f"sensitivity probe: TP rank 1's optimizer update of its {PARAM} shard off by a relative d "
    "(a per-rank learning-rate or optimizer-state error)",
)

NORM_GRAD = _scaled_mutant(
    "norm-grad",
    f"every rank's {NORM_PARAM} grad x (1 + d)",
    f"sensitivity probe: the {NORM_PARAM} grad (a replicated LayerNorm weight's, summed over the TP ranks) "
    "off by a relative d on every rank after the grad sync (a norm grad summed over too few or too many "
    "ranks, or mis-scaled)",
)

CASES = {"forward": FORWARD, "grad": GRAD, "update": UPDATE, "norm-grad": NORM_GRAD}
