"""User-style case file for the training-step check's judging (tests/test_train_step_judging.py): a
hand-written TP + SP MLP with a vocabulary head, and its own training step written the way a user
writes one: each rank's token-loss sum over the global valid-token count, the grads of the params
replicated over the sequence group summed over it after the last micro-batch, every grad summed
over DP, and a clip norm whose squares are summed in float32 (float64 in a float64 run), TP-split
params counted on every rank and replicated ones on TP rank 0 only. `UserBugs` makes it wrong in
one place each; all unset is the correct step."""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_harness import Case, Layout, ParamSpec, Sharded
from sp_harness.cases.megatron.mappings import gather_from_sp, reduce_scatter_to_sp
from sp_harness.config.step_protocol import TrainLoss
from sp_harness.step.optim_ref import make_optimizer

WIDTH, HIDDEN, VOCAB = 8, 32, 16
"""down.weight (TP-split, 256 elements) and head.weight (replicated, 128) are both past the ~124
elements where a norm bound in bfloat16 arithmetic (gamma_m with m u >= 1/2) reached the share
itself: a param left out of the norm, or counted twice, passed there."""
REPLICATED = ("down.bias", "head.weight")
"""Params every TP rank holds whole, applied to its own sequence shard: their grads are partial sums."""
CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s guard in max_norm / (norm + eps)."""


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Linear(HIDDEN, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):  # (B, S, WIDTH) -> (B, S, VOCAB)
        return self.head(x + self.down(torch.relu(self.up(x))))


class ShardedNet(Net):
    """up column-parallel, down row-parallel, the sequence sharded outside them (Megatron's SP)."""

    def __init__(self, ref: Net, ctx):
        super().__init__()
        self.sizes, self.group = ctx.seq_shards, ctx.tp_group
        r, tp = ctx.tp_rank, ctx.tp
        with torch.no_grad():
            for name, p in ref.named_parameters():
                local = dict(self.named_parameters())[name]
                whole = p.detach()
                if name in ("up.weight", "up.bias"):
                    whole = whole.chunk(tp, 0)[r]
                elif name == "down.weight":
                    whole = whole.chunk(tp, 1)[r]
                local.data = whole.clone()

    def forward(self, x):  # (B, S_r, WIDTH) -> (B, S_r, VOCAB)
        full = gather_from_sp(x, 1, self.sizes, self.group)
        partial = F.linear(torch.relu(F.linear(full, self.up.weight, self.up.bias)), self.down.weight)
        return self.head(x + reduce_scatter_to_sp(partial, 1, self.sizes, self.group) + self.down.bias)


@dataclasses.dataclass(frozen=True)
class UserBugs:
    skip_seq_sync: bool = False
    """The replicated params' grads never summed over the sequence group after the last
    micro-batch. At TP 2, DP 1 only the rank holding no valid token has wrong grads (zero): the
    other rank's own partial sum is the whole one."""
    empty_rank_keeps_own: bool = False
    """A rank whose micro-batches hold no valid token sums the replicated grads over the sequence
    group like every rank but keeps its own (zero) copy, having had nothing to add: at any TP
    with DP 1 it is the only rank whose grads are wrong."""
    clip_skips: str = ""
    """A param the clip norm leaves out (a TP-split one: megatron's attention sinks)."""
    counted_on_every_tp_rank: str = ""
    """A replicated param the clip norm counts on every TP rank (twice at TP 2), not once."""


def _sum(t, group=None):
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


class UserStep:
    def __init__(self, module, ctx, bugs: UserBugs):
        cfg = ctx.config
        self.module, self.ctx, self.bugs, self.clip = module, ctx, bugs, cfg.clip_grad_norm
        self.named = dict(module.named_parameters())
        self.optimizer = make_optimizer(cfg.optimizer, cfg.lr, self.named.values())
        self.acc = torch.promote_types(next(iter(self.named.values())).dtype, torch.float32)

    def accumulate(self, micro_batches):
        counts = torch.stack([mb.valid.sum() for mb in micro_batches]).to(torch.float64)
        total = _sum(counts.sum().clone()).clamp(min=1)
        sums = torch.zeros((), dtype=torch.float64)
        for mb in micro_batches:
            loss_sum = F.cross_entropy(mb.call(self.module).flatten(0, -2), mb.target.flatten(), reduction="sum")
            sums += loss_sum.detach().to(torch.float64)
            (loss_sum / total).backward()
        for p in self.named.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.ctx.tp > 1 and not self.bugs.skip_seq_sync:
            for name in REPLICATED:
                g = self.named[name].grad
                summed = _sum(g.clone(), self.ctx.tp_group)
                if counts.sum() > 0 or not self.bugs.empty_rank_keeps_own:
                    g.copy_(summed)
        if self.ctx.dp > 1:
            for p in self.named.values():
                _sum(p.grad, self.ctx.dp_group)
        return _sum(sums) / total

    def grad_norm(self):
        sq = torch.zeros((), dtype=self.acc)
        for name, p in self.named.items():
            if p.grad is None or name == self.bugs.clip_skips:
                continue
            once = name not in REPLICATED or self.ctx.tp_rank == 0 or name == self.bugs.counted_on_every_tp_rank
            if once:
                sq += p.grad.detach().to(self.acc).pow(2).sum()
        return _sum(sq, self.ctx.tp_group).sqrt()

    def step(self):
        norm = self.grad_norm()
        if self.clip is not None:
            coef = torch.clamp(self.clip / (norm + CLIP_EPS), max=1.0)
            for p in self.named.values():
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def _reference(cfg):
    torch.manual_seed(cfg.seed)
    return Net().double()


def _batch(cfg, step, gen):
    x = torch.randn(cfg.batch, cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, VOCAB, (cfg.batch, cfg.seq_len), generator=gen)


def _shard(bugs: UserBugs):
    def shard(model, ctx):
        module = ShardedNet(model, ctx)
        return Sharded(module=module, input_layout=Layout(seq_dim=1, batch_dim=0),
                       output_layout=Layout(seq_dim=1, batch_dim=0),
                       params={"up.weight": ParamSpec(ref_name="up.weight", dim=0),
                               "up.bias": ParamSpec(ref_name="up.bias", dim=0),
                               "down.weight": ParamSpec(ref_name="down.weight", dim=1)},
                       replicated=REPLICATED, train_step=UserStep(module, ctx, bugs))

    return shard


def _case(name: str, bugs: UserBugs = UserBugs()) -> Case:
    return Case(isolation="shared", name=name, description=name, build_reference=_reference, make_batch=_batch,
                shard=_shard(bugs), input_layout=Layout(seq_dim=1, batch_dim=0), knobs=None,
                loss_sum=lambda out, tgt: F.cross_entropy(out.flatten(0, -2), tgt.flatten(), reduction="sum"),
                tokens=lambda tgt: int((tgt != -100).sum()), train_loss=TrainLoss(),
                defaults=dict(seq_len=8, batch=2, steps=2, optimizer="sgd"))


CORRECT = _case("user-step")
SKIP_SEQ_SYNC = _case("user-step-skip-seq-sync", UserBugs(skip_seq_sync=True))
EMPTY_RANK_KEEPS_OWN = _case("user-step-empty-rank-keeps-own", UserBugs(empty_rank_keeps_own=True))
CLIP_SKIPS_DOWN = _case("user-step-clip-skips-down", UserBugs(clip_skips="down.weight"))
HEAD_COUNTED_TWICE = _case("user-step-head-counted-twice", UserBugs(counted_on_every_tp_rank="head.weight"))
