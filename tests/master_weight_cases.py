"""User-style case file: the built-in megatron-gpt-sp training step with an optimizer kept the way
megatron's and DeepSpeed's mixed-precision optimizers keep theirs (float32 master copies of the
params, the optimizer over the masters, each param a rounded copy of its master), so its state
is not readable per param and the training-step check judges the update with its float64 shadow
(sp_harness.step.shadow). `MASTERS` is correct; `NO_MASTERS` re-reads each master from its
low-precision param before every step (the masters might as well not exist); `LR_OFF` steps with
lr 1.05x the configured one."""

import dataclasses

import torch

from sp_harness.cases.megatron.cases import SP, megatron_shard
from sp_harness.cases.megatron.impl import CORRECT
from sp_harness.cases.train_steps import CLIP_EPS, FrameworkStep, marked_sequence_parallel, with_train_step
from sp_harness.step.optim_ref import make_optimizer


class MasterWeightsStep:
    """FrameworkStep's accumulation and norm; its optimizer over float32 master copies."""

    optimizer = None  # the masters' state is the optimizer's, not the params'

    def __init__(self, inner: FrameworkStep, *, keep_masters: bool = True, lr_scale: float = 1.0):
        config = inner.ctx.config
        self.inner, self.keep_masters, self.clip = inner, keep_masters, config.clip_grad_norm
        self.params = list(inner.named.values())
        master_dtype = torch.float64 if self.params[0].dtype == torch.float64 else torch.float32
        self.masters = [torch.nn.Parameter(p.detach().to(master_dtype).clone()) for p in self.params]
        self.opt = make_optimizer(config.optimizer, config.lr * lr_scale, self.masters)

    def accumulate(self, micro_batches):
        return self.inner.accumulate(micro_batches)

    def grad_norm(self):
        return self.inner.grad_norm()

    def step(self):
        norm = self.inner.grad_norm()
        coef = 1.0 if self.clip is None else torch.clamp(self.clip / (norm + CLIP_EPS), max=1.0)
        for p, m in zip(self.params, self.masters, strict=True):
            if not self.keep_masters:
                m.data.copy_(p.detach())
            m.grad = None if p.grad is None else p.grad.detach().to(m.dtype) * coef
        self.opt.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.data.copy_(m.detach())
            p.grad = m.grad = None
        return norm


def _case(name: str, **knobs):
    base = with_train_step(megatron_shard(CORRECT, sequence_parallel=True), marked_sequence_parallel)

    def shard(ref, ctx):
        sharded = base(ref, ctx)
        return dataclasses.replace(sharded, train_step=MasterWeightsStep(sharded.train_step, **knobs))

    return dataclasses.replace(SP, name=name, shard=shard, examples=(), twin="", baseline="")


MASTERS = _case("megatron-gpt-sp-masters")
NO_MASTERS = _case("megatron-gpt-sp-no-masters", keep_masters=False)
LR_OFF = _case("megatron-gpt-sp-lr-off", lr_scale=1.05)
