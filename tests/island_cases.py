"""User-style case file for precision islands (issue 19): a sequence-parallel model that computes
some ops in float32 on purpose, as frameworks do, loaded as `tests/island_cases.py:NAME`.

Three islands, each what a real framework does: an RMSNorm that normalises in float32 and casts
back (LLaMA's), a sequence-pooled context accumulated in float32 and summed across the SP ranks
in float32 (a fused reduction kernel's accumulator), and a cross-entropy over logits cast to
float32 (megatron-core's). In a float64 run the pooled context and the loss are float32 sums in
another order on the shards than in the reference: one-ulp float32 differences, which only a
tolerance model that knows those ops ran in float32 can tell from a bug.

The FUSED cases hide the context's float32 inside one custom op with float64 inputs and output,
as a fused GPU kernel would: no dtype shows it, so the case declares it (`precision_islands`).
"""

# These cases change no process-wide state: they share the built-in cases' rank processes
# (Case.isolation), which keeps the suite from starting a pool per case.

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from sp_harness import Case, Layout, Sharded
from sp_harness.config.registry import mutant

WIDTH, VOCAB = 8, 12


class Float32RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden) + 0.1 * torch.randn(hidden))

    def forward(self, h):
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(h.dtype)


class Float32Context(nn.Module):
    """The sequence mean of h, accumulated in float32, added back to every token. Sharded: each
    rank sums its own tokens and the partial sums are all-reduced (in float32) over the SP group."""

    def __init__(self):
        super().__init__()
        self.group, self.seq_len, self.partial_scale = None, None, 1.0

    def forward(self, h):
        total = h.float().sum(0)
        if self.group is not None:
            total = dist_fn.all_reduce(total * self.partial_scale, group=self.group)
        return h + (total / (self.seq_len or h.shape[0])).to(h.dtype)


@torch.library.custom_op("sp_harness_island_cases::seq_sum_f32", mutates_args=())
def seq_sum_f32(h: torch.Tensor) -> torch.Tensor:
    """A fused kernel: the sum over dim 0, accumulated in float32, returned in h's dtype. A
    dispatch mode sees this one op, not the float32 inside it."""
    return h.float().sum(0).to(h.dtype)


@seq_sum_f32.register_fake
def _(h):
    return h.new_empty(h.shape[1:])


@torch.library.custom_op("sp_harness_island_cases::round_f32", mutates_args=())
def round_f32(x: torch.Tensor) -> torch.Tensor:
    """Its backward's kernel: the grad through float32."""
    return x.float().to(x.dtype, copy=True)


@round_f32.register_fake
def _(x):
    return torch.empty_like(x)


def _seq_sum_setup(ctx, inputs, output):
    ctx.shape = inputs[0].shape


seq_sum_f32.register_autograd(lambda ctx, grad: round_f32(grad).unsqueeze(0).expand(ctx.shape),
                              setup_context=_seq_sum_setup)


class FusedContext(Float32Context):
    """Float32Context as one fused kernel: float64 in and out, float32 inside."""

    def forward(self, h):
        total = seq_sum_f32(h)
        if self.group is not None:
            total = dist_fn.all_reduce(total * self.partial_scale, group=self.group)
        return h + total / (self.seq_len or h.shape[0])


class IslandLM(nn.Module):
    def __init__(self, hidden: int, fused: bool = False):
        super().__init__()
        self.up = nn.Linear(WIDTH, hidden)
        self.context = FusedContext() if fused else Float32Context()
        # the fused model's one island is its context kernel: no float32 tensor anywhere
        self.norm = nn.LayerNorm(hidden) if fused else Float32RMSNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x):  # (S, WIDTH) -> (S, VOCAB)
        return self.head(self.norm(self.context(torch.tanh(self.up(x)))))


def reference(cfg):
    torch.manual_seed(cfg.seed)
    return IslandLM(cfg.hidden).double()


def fused_reference(cfg):
    torch.manual_seed(cfg.seed)
    return IslandLM(cfg.hidden, fused=True).double()


def batch(cfg, step, gen):
    x = torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.randint(VOCAB, (cfg.seq_len,), generator=gen)


def cross_entropy_sum(out, tgt):
    # megatron-core's cross-entropy: the logits cast to float32 first, whatever the run's dtype
    return F.cross_entropy(out.float(), tgt, reduction="sum")


def _sync(model, ctx):
    def sync():  # every param is replicated: its grad is the sum of the ranks' token shares
        for p in model.parameters():
            dist.all_reduce(p.grad, group=ctx.tp_group)
    return sync


def shard(model, ctx, partial_scale: float = 1.0):
    model.context.group, model.context.seq_len = ctx.tp_group, ctx.config.seq_len
    if ctx.tp_rank == 1:
        model.context.partial_scale = partial_scale
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0),
                   replicated=("*",), sync_grads=_sync(model, ctx))


ISLAND_LM = Case(isolation="shared", name="island-lm", description="SP model with float32 islands (norm, pooled context, loss)",
                 build_reference=reference, make_batch=batch, shard=shard, loss_sum=cross_entropy_sum,
                 tokens=lambda tgt: tgt.shape[0], defaults=dict(seq_len=16, hidden=16))

ISLAND_LM_SCALED = mutant(
    ISLAND_LM, name="mutant-island-lm-scaled-partial",
    summary="rank 1's float32 partial sum of the pooled context scaled by (1 + 1e-3)",
    bug="a shard's partial reduction carried a wrong factor inside a float32 island (a stale scale, a "
        "rank-dependent normaliser): wrong by 1e-3, a thousand times float32's rounding",
    source="issue 19 (precision islands): a real bug in or around the island must still FAIL",
    shard=lambda model, ctx: shard(model, ctx, partial_scale=1 + 1e-3))

FUSED_UNDECLARED = Case(
    isolation="shared", name="fused-lm-undeclared", description="SP model whose pooled context is a fused kernel accumulating in float32",
    build_reference=fused_reference, make_batch=batch, shard=shard,
    loss_sum=lambda out, tgt: F.cross_entropy(out, tgt, reduction="sum"), tokens=lambda tgt: tgt.shape[0],
    defaults=dict(seq_len=16, hidden=16))

FUSED = dataclasses.replace(FUSED_UNDECLARED, name="fused-lm", precision_islands={"context": "float32"})

FUSED_SCALED = mutant(
    FUSED, name="mutant-fused-lm-scaled-partial",
    summary="rank 1's partial sum out of the fused float32 kernel scaled by (1 + 1e-3)",
    bug="a shard's partial reduction carried a wrong factor right after a declared float32 island",
    source="issue 19 (precision islands): a real bug in or around a declared island must still FAIL",
    shard=lambda model, ctx: shard(model, ctx, partial_scale=1 + 1e-3))
