"""torch-cp-gpt: PyTorch's own context parallelism (`torch.distributed.tensor.experimental.
context_parallel`) on the reference GPT, run as a user would run it on CPU.

Stage: config and step. world_size = dp x cp; the engine's TP group is the CP
group (a 1-D DeviceMesh over it). Every parameter is a replicated copy, grads are SUMMED over CP
and averaged over DP (`sum_replicated_grads`, as ring-gpt's). Each rank gets the whole sequence of its batch
rows; the model's forward enters `context_parallel(mesh, buffers=[tokens, positions],
buffer_seq_dims=[1, 1])`, which cuts them itself (torch.chunk, head-tail permuted when its load
balancer is on and 2W divides seq_len), and each attention calls `F.scaled_dot_product_attention`
(the reference's explicit softmax, the same mathematics), which `context_parallel` patches.

What torch 2.13 does with that on CPU (measured, docs/findings.md): the patched SDPA wraps
q/k/v as DTensors Shard(2), but its ring handlers cover only the CUDA kernels (flash, efficient,
cuDNN); CPU SDPA dispatches `aten._scaled_dot_product_flash_attention_for_cpu`, which DTensor
shards by its generic decomposition (no ring) where it can. So:
- `torch-cp-gpt` (CPU SDPA as chosen by torch): causal raises in forward, non-causal in
  backward (`..._for_cpu_backward` has neither a sharding strategy nor a decomposition);
- `torch-cp-gpt-math` (SDPA forced onto the math kernel, `sdpa_kernel(SDPBackend.MATH)`):
  non-causal runs forward and backward through DTensor's op-by-op sharding (all-gathers, not a
  ring); causal raises (the math kernel adds a plain-tensor causal mask to a DTensor).
Uneven shards (seq_len % W != 0) fail under the math kernel too: 4/4/2 desyncs (the patched SDPA's
`DTensor.from_local` assumes even shards, so the ranks all-gather different sizes) and a rank
with no tokens (2/2/2/0) raises alone.
`Case.expect` pins these; the rotate method (`set_rotate_method`) never matters here because the
ring is never entered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options
from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sp_harness.cases.common import (
    GPT_DEFAULTS,
    as_gpt,
    attention_of,
    gpt_fields,
    known,
    require_chunk_split,
    require_heads,
    require_whole_cp_group,
    sum_replicated_grads,
    with_defaults,
)
from sp_harness.config.case import Case, Example, Layout, Sharded
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import register
from sp_harness.reference.gpt import GPT, Attention

DEFAULTS = dict(GPT_DEFAULTS, load_balancer="zigzag", causal=True)
"""A small GPT; the load balancer on, as `_cp_options.enable_load_balance` is by default."""


def balanced(load_balancer: str, seq_len: int, cp: int) -> bool:
    """Whether `context_parallel` permutes the sequence: its default head-tail balancer is used
    only when it is enabled AND 2W divides seq_len (`_create_default_load_balancer`); otherwise it
    silently falls back to contiguous torch.chunk shards."""
    return load_balancer == "zigzag" and seq_len % (2 * cp) == 0


def torch_placement(load_balancer: str) -> Callable[[int, tuple[int, ...]], torch.Tensor]:
    """load_balancer -> Layout.seq_order: PyTorch's own permutation (2W chunks, rank i holds
    chunks i and 2W-1-i), taken from its balancer, or the identity where it does not balance."""

    def order(seq_len: int, seq_shards: tuple[int, ...]) -> torch.Tensor:
        cp = len(seq_shards)
        if not balanced(load_balancer, seq_len, cp):
            return torch.arange(seq_len)
        return _HeadTailLoadBalancer(seq_len, cp, torch.device("cpu"))._generate_indices(restore=False)[0]  # (S,)

    return order


def validate(config: CheckConfig) -> None:
    config = with_defaults(config, DEFAULTS)
    require_whole_cp_group(config, "torch-cp-gpt")
    # context_parallel cuts its buffers with DTensor Shard(1), i.e. torch.chunk
    require_chunk_split(config, "torch-cp-gpt")
    require_heads(config)


class SDPAAttention(Attention):
    """The reference's attention (same projections, names and weights) through
    `F.scaled_dot_product_attention`, looked up at call time so `context_parallel`'s patch applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, s, H): this rank's tokens
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # (B, a, s, d)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, a_kv, s, d)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, a_kv, s, d)
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # as the reference: each k/v head serves `group` consecutive query heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, a, s, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, a, s, d); scale 1/sqrt(d)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))  # (B, s, H)


class ContextParallelGPT(GPT):
    """The reference GPT whose forward runs under `context_parallel`: it takes the whole sequence
    and returns this rank's logits (B, s_r, V), in PyTorch's placement."""

    def setup(self, *, mesh, load_balancer: str, math: bool) -> ContextParallelGPT:
        self.cp_mesh, self.load_balancer, self.math = mesh, load_balancer, math
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # context_parallel shards its buffers in place: hand it copies of the engine's inputs
        tokens = tokens.clone()  # (B, S) int64
        positions = (torch.arange(tokens.shape[1]).expand_as(tokens) if positions is None else positions).clone()
        # the balancer switch is PyTorch's process-global option: set it for this call only, as
        # the warm rank process runs other jobs next
        before = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = self.load_balancer == "zigzag"
        kernel = sdpa_kernel(SDPBackend.MATH) if self.math else contextlib.nullcontext()
        try:
            with kernel, context_parallel(self.cp_mesh, buffers=[tokens, positions], buffer_seq_dims=[1, 1],
                                          no_restore_buffers={tokens, positions}):
                return super().forward(tokens, positions)  # (B, s_r, V)
        finally:
            _cp_options.enable_load_balance = before


def torch_cp_shard(*, math: bool) -> Callable[[nn.Module, RankContext], Sharded]:
    """The sharded factory: the reference GPT (same weights) under context_parallel."""

    def shard(ref: nn.Module, ctx: RankContext) -> Sharded:
        balancer = known(with_defaults(ctx.config, DEFAULTS).load_balancer, "load_balancer")
        mesh = ctx.device_mesh if ctx.dp == 1 else ctx.device_mesh["tp"]  # 1-D over the CP group
        gpt = as_gpt(ref)
        for block in gpt.blocks:
            attention_of(block).__class__ = SDPAAttention
        gpt.__class__ = ContextParallelGPT  # the same modules and weights, context_parallel's forward
        assert isinstance(gpt, ContextParallelGPT)
        model = gpt.setup(mesh=mesh, load_balancer=balancer, math=math)
        whole = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)  # context_parallel cuts the sequence itself
        out = Layout(seq_dim=1, batch_dim=0, seq_order=torch_placement(balancer))
        return Sharded(module=model, input_layout=whole, output_layout=out, replicated=("*",),
                       sync_grads=lambda: sum_replicated_grads(model, ctx))

    return shard


def _expect_default(config: CheckConfig) -> str:
    # torch 2.13 on CPU: causal raises in forward (no sharding strategy for
    # _scaled_dot_product_flash_attention_for_cpu), non-causal in backward (nor for its backward)
    return "FAIL"


def _expect_math(config: CheckConfig) -> str:
    # torch 2.13 on CPU, math kernel: non-causal on even shards runs (DTensor op-by-op sharding);
    # causal raises (plain-tensor mask added to a DTensor); uneven shards desync (from_local) or,
    # with an empty rank, raise there
    config = with_defaults(config, DEFAULTS)
    return "PASS" if not config.causal and known(config.seq_len, "seq_len") % config.tp == 0 else "FAIL"


def _case(*, name: str, math: bool, description: str, expect: Callable[[CheckConfig], str],
          examples: tuple[Example, ...]) -> Case:
    return register(Case(
        name=name,
        description=description,
        **gpt_fields(DEFAULTS, positions=True),
        shard=torch_cp_shard(math=math),
        validate=validate,
        tags=("torch-cp", "context-parallel"),
        expect=expect,
        examples=examples,
    ))


TORCH_CP = _case(
    name="torch-cp-gpt",
    math=False,
    description="PyTorch's context_parallel (torch.distributed.tensor.experimental) on the GPT, CPU SDPA as torch picks it",
    expect=_expect_default,
    examples=(
        # non-causal is left out: its forward spends ~50 s in DTensor's decomposition-based
        # sharding propagation before the backward raises (tests/test_torch_cp.py pins it)
        Example(fields=(("world_size", 2),), note="upstream: causal raises in forward (CPU flash SDPA, no CP handler)"),
    ),
)

TORCH_CP_MATH = _case(
    name="torch-cp-gpt-math",
    math=True,
    description="PyTorch's context_parallel on the GPT with SDPA forced onto the math kernel (CPU)",
    expect=_expect_math,
    examples=(
        Example(fields=(("world_size", 2), ("causal", False)), note="non-causal, head-tail placed: PASS (no ring)"),
        Example(fields=(("world_size", 2),), note="upstream: causal math SDPA adds a plain mask to a DTensor"),
    ),
)

__all__ = ["TORCH_CP", "TORCH_CP_MATH", "torch_cp_shard", "torch_placement", "balanced", "validate"]
