"""User-style case file: a plain DDP model with a float input (no sequence sharding at all).

It pins the engine's DP convention on a case whose input has a grad: each replica's loss is the
mean over its own micro-batch and grads are averaged over DP, as DDP does. `DDP_MLP` is correct
and must PASS with dp > 1; `DDP_DOUBLE_AVERAGE` divides each replica's loss by the global token
count and then averages grads over DP too (grads dp times too small) and must FAIL.
"""

# These cases change no process-wide state: they share the built-in cases' rank processes
# (Case.isolation), which keeps the suite from starting a pool per case.

import dataclasses

import torch
import torch.distributed as dist

from sp_harness.config.case import Case, Layout, Sharded


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 16), torch.nn.Linear(16, 6)

    def forward(self, x):  # (B, S, 6) -> (B, S, 6)
        return self.down(torch.tanh(self.up(x)))


class InplaceMLP(MLP):
    def __init__(self):
        super().__init__()
        self.act = torch.nn.ReLU(inplace=True)  # an in-place module: no hook may break it

    def forward(self, x):  # (B, S, 6) -> (B, S, 6)
        return self.down(self.act(self.up(x)))


def _reference(cfg):
    torch.manual_seed(cfg.seed)
    return MLP().double()


def _inplace_reference(cfg):
    torch.manual_seed(cfg.seed)
    return InplaceMLP().double()


def _batch(cfg, step, gen):
    shape = (cfg.dp * cfg.batch, cfg.seq_len, 6)
    return (torch.randn(shape, generator=gen, dtype=torch.float64),
            torch.randn(shape, generator=gen, dtype=torch.float64))


def _loss_sum(out, tgt):
    return ((out - tgt) ** 2).sum()


def _tokens(tgt):
    return tgt.shape[0] * tgt.shape[1]


IO = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)


def _average_over_dp(model, ctx):
    for p in model.parameters():
        if p.grad is not None and ctx.dp > 1:
            dist.all_reduce(p.grad, group=ctx.dp_group)
            p.grad /= ctx.dp


def _ddp(model, ctx):
    return Sharded(module=model, input_layout=IO, output_layout=IO, sync_grads=lambda: _average_over_dp(model, ctx),
                   replicated=("*",))


def _ddp_double_average(model, ctx):
    def loss(out, tgt, ctx):  # divides by the GLOBAL token count, then grads are averaged again
        return _loss_sum(out, tgt) / (_tokens(tgt) * ctx.dp)

    return Sharded(module=model, input_layout=IO, output_layout=IO, local_loss=loss,
                   sync_grads=lambda: _average_over_dp(model, ctx), replicated=("*",))


def _case(name, shard):
    return Case(isolation="shared", name=name, description=name, build_reference=_reference, make_batch=_batch, loss_sum=_loss_sum,
                tokens=_tokens, shard=shard, defaults=dict(seq_len=5), input_layout=IO)


DDP_MLP = _case("ddp-mlp", _ddp)
DDP_DOUBLE_AVERAGE = _case("ddp-double-average", _ddp_double_average)
DDP_INPLACE = dataclasses.replace(_case("ddp-inplace", _ddp), build_reference=_inplace_reference)
