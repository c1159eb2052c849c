"""Cases that behave like third-party SP code does, for the engine's isolation tests:

- `REGISTERING`: the sharded factory registers its attention process-wide (as DeepSpeed's
  `UlyssesSPAttentionHF.register_with_transformers` replaces transformers' "sdpa" function);
  the reference calls the same registry, so a reference computed where the registration happened
  runs the sharded attention on the whole sequence.
- `COMPLEX_ROPE`: a complex64 rotary cache (torchtitan's `freqs_cis`); the sharded model makes its
  own, so a cast that drops the imaginary part of the reference's cache is seen.
- `HOLDS_GROUP`: a model that keeps its process group (megatron-core's layers do): it cannot be
  deep-copied; its factory takes the rank context.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sp_harness import Case, Layout, Sharded
from sp_harness.config.registry import mutant

WIDTH = 8

# ---------------------------------------------------------------- a global attention registry

ATTENTION = {}


def causal_attention(q, k, v, *, query_offset=0):  # (S_q, D), (S, D), (S, D) -> (S_q, D)
    scores = q @ k.T / q.shape[-1] ** 0.5
    rows = torch.arange(q.shape[0], device=q.device)[:, None] + query_offset
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > rows, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


ATTENTION["sdpa"] = causal_attention


def register_sp_attention(query_offset: int) -> None:
    """What an SP library's registration does: every caller of the "sdpa" name now gets the
    attention of a rank holding the queries from `query_offset` on."""
    ATTENTION["sdpa"] = functools.partial(causal_attention, query_offset=query_offset)


class _GatherSeq(torch.autograd.Function):
    """forward: all-gather on seq dim (dim 0), equal shards (gloo); backward: the rank's slice of the summed grad."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        pieces = [x.new_empty((s, *x.shape[1:])) for s in sizes]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        start = sum(ctx.sizes[:rank])
        return grad[start:start + ctx.sizes[rank]], None, None


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.group, self.sizes = None, None  # set on a sharded copy

    def forward(self, x):  # (S, W) -> (S, W)
        k, v = self.kv(x).chunk(2, dim=-1)
        if self.group is not None:
            k, v = _GatherSeq.apply(k, self.group, self.sizes), _GatherSeq.apply(v, self.group, self.sizes)
        return ATTENTION["sdpa"](self.q(x), k, v)


def _registering_shard(model, ctx):
    model.group, model.sizes = ctx.tp_group, ctx.seq_shards
    register_sp_attention(sum(ctx.seq_shards[:ctx.tp_rank]))
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0),
                   replicated=("*",), sync_grads=functools.partial(_sum_grads, model, ctx))


def _sum_grads(model, ctx):
    for p in model.parameters():
        dist.all_reduce(p.grad, group=ctx.tp_group)


def _reference(cfg):
    torch.manual_seed(cfg.seed)
    return Attention().double()


def _batch(cfg, step, gen):
    return (torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(cfg.seq_len, WIDTH, generator=gen, dtype=torch.float64))


def _mse(out, tgt):
    return ((out - tgt) ** 2).sum()


REGISTERING = Case(name="registering", description="SP attention registered process-wide by the sharded factory",
                   build_reference=_reference, make_batch=_batch, shard=_registering_shard, loss_sum=_mse,
                   tokens=lambda t: t.shape[0], defaults=dict(seq_len=8))


# ---------------------------------------------------------------- a complex rotary cache


def rope_cache(seq_len: int, dim: int) -> torch.Tensor:  # (S, dim/2) complex64, as torchtitan's freqs_cis
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    return torch.polar(torch.ones(seq_len, dim // 2), torch.outer(torch.arange(seq_len).float(), freqs))


def apply_rope(x, cache):  # (S, W) real, (S, W/2) complex -> (S, W)
    pairs = torch.view_as_complex(x.float().reshape(x.shape[0], -1, 2).contiguous())
    return torch.view_as_real(pairs * cache).reshape(x.shape).to(x.dtype)


class RopeMLP(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.register_buffer("freqs_cis", rope_cache(seq_len, WIDTH), persistent=False)
        self.offset = 0

    def forward(self, x):  # (S, W) -> (S, W), position-wise: shards need only their cache rows
        rows = self.freqs_cis[self.offset:self.offset + x.shape[0]]
        return self.down(F.gelu(self.up(apply_rope(x, rows))))


def _rope_reference(cfg):
    torch.manual_seed(cfg.seed)
    return RopeMLP(cfg.seq_len).double()


def _rope_shard(model, ctx):
    model.freqs_cis = rope_cache(ctx.config.seq_len, WIDTH)  # the sharded side's own cache, as a framework makes it
    model.offset = sum(ctx.seq_shards[:ctx.tp_rank])
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0),
                   replicated=("*",), sync_grads=functools.partial(_sum_grads, model, ctx))


COMPLEX_ROPE = Case(name="complex-rope", description="a complex64 RoPE cache (float32 island)",
                    build_reference=_rope_reference, make_batch=_batch, shard=_rope_shard, loss_sum=_mse,
                    tokens=lambda t: t.shape[0], defaults=dict(seq_len=8, dtype="float32"))


# ---------------------------------------------------------------- a model holding its group


class GroupMLP(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group  # a ProcessGroup: deepcopy raises "cannot pickle"
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        assert dist.get_world_size(self.group) == 1, "the reference runs in its own one-rank group"
        return self.down(torch.relu(self.up(x)))


def _group_reference(cfg, ctx):
    assert ctx.world_size == 1 and ctx.seq_shards == (cfg.seq_len,), ctx
    torch.manual_seed(cfg.seed)
    return GroupMLP(ctx.tp_group).double()


def _group_shard(model, ctx):
    return Sharded(module=model, input_layout=Layout(seq_dim=0), output_layout=Layout(seq_dim=0),
                   replicated=("*",), sync_grads=functools.partial(_sum_grads, model, ctx))


HOLDS_GROUP = Case(name="holds-group", description="a model holding a process group; factory takes the rank context",
                   build_reference=_group_reference, make_batch=_batch, shard=_group_shard, loss_sum=_mse,
                   tokens=lambda t: t.shape[0], defaults=dict(seq_len=6))


def _registering_shard_wrong_offset(model, ctx):
    sharded = _registering_shard(model, ctx)
    register_sp_attention(0)  # every rank masks as if it held the first queries
    return sharded


REGISTERING_WRONG_OFFSET = mutant(REGISTERING, name="mutant-registering-wrong-offset",
                                  summary="the registered attention masks with query offset 0 on every rank",
                                  bug="a causal mask built from local positions under SP (the offset of the rank's "
                                      "queries dropped)",
                                  source="tests/third_party_cases.py (engine test)",
                                  shard=_registering_shard_wrong_offset)


class _Renamed(nn.Module):
    """An SP attention held one level down, as a framework's wrapper holds it (`self.sp_attn`):
    its name is the reference's attention name plus '.sp_attn'."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.sp_attn = inner

    def forward(self, x):
        return self.sp_attn(x)


def _renamed_ring_shard(model, ctx):
    import dataclasses

    from sp_harness import ParamSpec
    from sp_harness.cases.ring.cases import ring_shard

    sharded = ring_shard()(model, ctx)
    for block in model.blocks:
        block.attn = _Renamed(block.attn)
    # the wrapper renames the params too: each maps to the reference's own
    params = {name: ParamSpec(ref_name=name.replace(".sp_attn.", "."))
              for name, _ in model.named_parameters() if ".sp_attn." in name}
    return dataclasses.replace(sharded, params=params)


def _renamed_ring():
    import dataclasses

    from sp_harness.cases.ring.cases import RING

    return dataclasses.replace(RING, name="ring-renamed-attention",
                               description="a correct ring-gpt, its attention under another module name",
                               shard=_renamed_ring_shard)


RENAMED_RING = _renamed_ring()
"""A correct ring-gpt whose attention exposes its LSE under 'blocks.N.attn.sp_attn': the LSE
check cannot pair it with the reference's 'blocks.N.attn' and must say so."""
