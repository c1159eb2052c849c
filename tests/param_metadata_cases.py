"""User-style case file for tests/test_param_metadata.py: a hand-written TP MLP (up column-parallel,
down row-parallel, the sequence whole on every rank) whose sharding metadata lies about one param,
as megatron's unflagged attention sinks do: `up.bias` is TP-split (each rank holds its chunk of
the hidden units) but the case declares it replicated (`Sharded.replicated`, no ParamSpec dim).

- `LYING`: the side-by-side check maps `up.bias` by its shape, reports the finding and judges on.
- `LYING_STEP`: the user's own training step believes the metadata: its clip norm counts the
  params it was told are replicated on TP rank 0 alone, as megatron's grad norm does, so `up.bias`
  loses its other shards from the norm (the training-step check FAILs at the grad norm by name).
- `HONEST_STEP`: the same step with `up.bias` declared split (ParamSpec dim 0): PASS.
- `UNEVEN`: `up.weight` split unevenly (12 and 20 of 32 rows) and declared replicated: its shape
  cannot say which rows it holds: one line naming it, exit 2, nothing judged.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_harness import Case, Layout, ParamSpec, Sharded
from sp_harness.config.step_protocol import TrainLoss
from sp_harness.step.optim_ref import make_optimizer

WIDTH, HIDDEN, VOCAB = 8, 32, 16
UNEVEN_ROWS = (12, 20)
"""`UNEVEN`'s rows of up.weight per TP rank (TP 2): neither is half of 32."""
CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s guard in max_norm / (norm + eps)."""


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Linear(HIDDEN, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):  # (B, S, WIDTH) -> (B, S, VOCAB)
        return self.head(x + self.down(torch.relu(self.up(x))))


def _sum(t, group=None):
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    """Forward: identity; backward: the input grad's partial sums summed over TP (megatron's
    copy_to_tensor_model_parallel_region before a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad.clone(), ctx.group), None


class _SumOverTP(torch.autograd.Function):
    """Forward: the partial sums of a row-parallel layer summed over TP; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _sum(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ShardedNet(Net):
    """up's rows and down's columns split over TP (`rows`: each rank's count, None: even)."""

    def __init__(self, ref: Net, ctx, rows: tuple[int, ...] | None = None):
        super().__init__()
        self.group, r = ctx.tp_group, ctx.tp_rank
        sizes = list(rows or [HIDDEN // ctx.tp] * ctx.tp)
        start = sum(sizes[:r])
        pick = slice(start, start + sizes[r])
        with torch.no_grad():
            for name, p in ref.named_parameters():
                whole = p.detach()
                if name in ("up.weight", "up.bias"):
                    whole = whole[pick]
                elif name == "down.weight":
                    whole = whole[:, pick]
                dict(self.named_parameters())[name].data = whole.clone()

    def forward(self, x):
        hidden = F.linear(_CopyToTP.apply(x, self.group), self.up.weight, self.up.bias)
        partial = F.linear(torch.relu(hidden), self.down.weight)
        return self.head(x + _SumOverTP.apply(partial, self.group) + self.down.bias)


class UserStep:
    """A user's training step: the token-loss sum over the global valid-token count, grads summed
    over DP, and a clip norm that counts the params its metadata calls replicated on TP rank 0
    only (every other param on every TP rank), summed over TP."""

    def __init__(self, module, ctx, replicated: tuple[str, ...]):
        cfg = ctx.config
        self.module, self.ctx, self.clip, self.replicated = module, ctx, cfg.clip_grad_norm, replicated
        self.named = dict(module.named_parameters())
        self.optimizer = make_optimizer(cfg.optimizer, cfg.lr, self.named.values())

    def accumulate(self, micro_batches):
        counts = torch.stack([mb.valid.sum() for mb in micro_batches]).to(torch.float64)
        total = _sum(counts.sum().clone(), self.ctx.dp_group).clamp(min=1)
        sums = torch.zeros((), dtype=torch.float64)
        for mb in micro_batches:
            loss_sum = F.cross_entropy(mb.call(self.module).flatten(0, -2), mb.target.flatten(), reduction="sum")
            sums += loss_sum.detach().to(torch.float64)
            (loss_sum / total).backward()
        if self.ctx.dp > 1:
            for p in self.named.values():
                _sum(p.grad, self.ctx.dp_group)
        return _sum(sums, self.ctx.dp_group) / total

    def grad_norm(self):
        sq = torch.zeros((), dtype=torch.float64)
        for name, p in self.named.items():
            if name not in self.replicated or self.ctx.tp_rank == 0:
                sq += p.grad.detach().to(torch.float64).pow(2).sum()
        return _sum(sq, self.ctx.tp_group).sqrt()

    def step(self):
        norm = self.grad_norm()
        if self.clip is not None:
            coef = torch.clamp(self.clip / (norm + CLIP_EPS), max=1.0)
            for p in self.named.values():
                p.grad.mul_(coef.to(p.grad.dtype))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def _reference(cfg):
    torch.manual_seed(cfg.seed)
    return Net().double()


def _batch(cfg, step, gen):
    x = torch.randn(cfg.dp * cfg.batch, cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, VOCAB, (cfg.dp * cfg.batch, cfg.seq_len), generator=gen)


def _shard(*, bias_declared_split: bool, step: bool = False, rows: tuple[int, ...] | None = None):
    def shard(model, ctx):
        module = ShardedNet(model, ctx, rows)
        split = {"down.weight": ParamSpec(ref_name="down.weight", dim=1)}
        if rows is None:
            split["up.weight"] = ParamSpec(ref_name="up.weight", dim=0)
        if bias_declared_split:
            split["up.bias"] = ParamSpec(ref_name="up.bias", dim=0)
        replicated = tuple(n for n, _ in module.named_parameters() if n not in split)
        whole = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)
        return Sharded(module=module, input_layout=whole, output_layout=whole, params=split, replicated=replicated,
                       train_step=UserStep(module, ctx, replicated) if step else None)

    return shard


def _case(name: str, **shard) -> Case:
    return Case(isolation="shared", name=name, description=name, build_reference=_reference, make_batch=_batch,
                shard=_shard(**shard), input_layout=Layout(seq_dim=1, batch_dim=0), knobs=None,
                loss_sum=lambda out, tgt: F.cross_entropy(out.flatten(0, -2), tgt.flatten(), reduction="sum"),
                tokens=lambda tgt: int((tgt != -100).sum()), train_loss=TrainLoss(),
                defaults=dict(seq_len=8, batch=2, steps=2, optimizer="sgd"))


LYING = _case("metadata-lies", bias_declared_split=False)
LYING_STEP = _case("metadata-lies-step", bias_declared_split=False, step=True)
HONEST_STEP = _case("metadata-honest-step", bias_declared_split=True, step=True)
UNEVEN = _case("metadata-uneven-rows", bias_declared_split=True, rows=UNEVEN_ROWS)
