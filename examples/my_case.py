import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from sp_harness import Case, Layout, Sharded


class MLP(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, hidden), torch.nn.Linear(hidden, 16)

    def forward(self, x):  # (S, 16) -> (S, 16)
        return self.down(torch.relu(self.up(x)))


def shard(model, ctx):  # this rank's sharded copy of the reference (same weights)
    plan = {"up": ColwiseParallel(input_layouts=Shard(0)), "down": RowwiseParallel(output_layouts=Shard(0))}
    return Sharded(module=parallelize_module(model, ctx.device_mesh, plan),
                   input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0))


def reference(cfg):  # the single-device model, deterministic in the seed
    torch.manual_seed(cfg.seed)
    return MLP(cfg.hidden).double()


def batch(cfg, step, gen):  # global input and target for one step
    return torch.randn(cfg.seq_len, 16, generator=gen, dtype=torch.float64), torch.randn(cfg.seq_len, 16, generator=gen, dtype=torch.float64)


MY_MLP = Case(name="my-mlp", description="my sequence-parallel MLP", shard=shard, make_batch=batch,
              build_reference=reference,
              loss_sum=lambda out, tgt: ((out - tgt) ** 2).sum(), tokens=lambda tgt: tgt.shape[0],
              defaults=dict(seq_len=8, hidden=64))
