"""Stage: step. torchtitan's context parallelism (`torchtitan_case(..., context_parallel=N)`) on
CPU: its own CP path for SDPA, with torch's ring attention reached through the opt-in CPU shim
`cp_cpu_ring.cpu_ring_attention` (the only change; docs/frameworks/torchtitan.md).

What runs is torchtitan's, in the order its trainer runs it (the `partial_dtensor` backend):
- `apply_cp_to_forward` over every block's `ScaledDotProductAttention` (what `parallelize_llama`
  does when `cp_enabled`): it turns on torch's CP dispatcher and wraps each attention's q/k/v as
  DTensors `Shard(1)` on the CP mesh (SDPA sees `Shard(2)` after its own transpose);
- `apply_fsdp_to_decoder` on the CP mesh: torchtitan's "fsdp" mesh is dp_shard x cp, so at DP 1
  its grad sync over CP is FSDP2 on the CP group, with its grad division off (a CP rank's loss is
  its own tokens' share of the replica's, so the SUM over CP is the replica's grad);
- per forward, `prepare_context_parallel_input(tokens, labels, {"positions": ...}, cp_mesh, ...)`
  with its default load balancer ("headtail"): tokens and RoPE positions cut by the same
  `_context_parallel_shard` (a forward pre-hook on the model, so module names stay torchtitan's).
  The positions are what its text datasets yield for one document per row (`arange(seq_len)`).
The engine's TP group is the CP group (as torch-cp-gpt's); the output comes back in the load
balancer's order (`Layout.seq_order`, torch's own `_HeadTailLoadBalancer` permutation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sp_harness import Layout, RankContext, Sharded
from sp_harness.cases.common import known
from sp_harness.config.check_config import CheckConfig

LOAD_BALANCER = "headtail"
"""torchtitan's `parallelism.context_parallel_load_balancer` default (configs.py), for SDPA."""
CP_FLOAT64 = ("torchtitan's CP ring is torch's, which merges the per-block attention outputs in float32 "
              "(_cp_options.convert_to_f32; measured, 2 gloo ranks: a float64 run FAILs at the forward, 5.8x its "
              "bound, the merge's sigmoid / log_sigmoid named as float32 ops), and CUDA's flash kernels have no float64")
"""Why `context_parallel > 1` at float64 is Unsupported."""


def cp_limits(cfg: CheckConfig, cp: int, tp: int | None, spmd_backend: str, attn_backend: str) -> str | None:
    """Why a CP run cannot be verified here (None: it can); decided from the config alone."""
    if spmd_backend != "partial_dtensor":
        return (f"torchtitan refuses SDPA + CP on the {spmd_backend} backend (validate_config: 'Use FlexAttention + "
                "CP'), and FlexAttention has no CPU backward")
    if attn_backend != "sdpa":
        return "torchtitan's FlexAttention CP runs flex_attention, which has no CPU backward"
    if tp not in (None, 1):
        return f"torchtitan CP x TP (tp={tp}): the engine's mesh has one sequence axis; CP runs at TP 1"
    if cfg.tp != cp:
        return (f"context_parallel={cp}: the run's CP group is world_size / dp = {cfg.tp} ranks; run it at "
                f"--world-size {cp}")
    if cfg.dtype == "float64":
        return CP_FLOAT64
    if cfg.seq_shards is not None:
        return "torchtitan's CP cuts the sequence itself (its load balancer), no explicit seq_shards"
    if known(cfg.seq_len, "seq_len") % (2 * cp):
        return (f"torchtitan: context parallelism requires seq_len ({cfg.seq_len}) divisible by 2 x CP ({2 * cp}) "
                "(ParallelDims.seq_len_divisor, its head-tail load balancer)")
    return None


def headtail_order(seq_len: int, seq_shards: tuple[int, ...]) -> torch.Tensor:
    """Layout.seq_order: torch's `_HeadTailLoadBalancer` permutation (2W chunks, rank i holds
    chunks i and 2W-1-i), the one torchtitan's `cp_shard` applies."""
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    return _HeadTailLoadBalancer(seq_len, len(seq_shards), torch.device("cpu"))._generate_indices(restore=False)[0]


def _cp_hooks(cp_mesh, *, shard_positions: bool):
    """The model's forward pre-hook (torchtitan's CP cut of tokens and positions, then the ring
    shim entered) and forward hook (the shim left; the backward needs no block: cp_cpu_ring)."""
    from sp_harness.cases.frameworks.cp_cpu_ring import cpu_ring_attention

    entered: list[contextlib.AbstractContextManager[None]] = []

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from torchtitan.distributed.context_parallel import prepare_context_parallel_input

        tokens = kwargs.pop("tokens") if "tokens" in kwargs else args[0]
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        # labels are cut by the engine (by the same order); torchtitan's call wants a tensor there
        tokens, _, extra = prepare_context_parallel_input(tokens, tokens.clone(), {"positions": positions}, cp_mesh,
                                                          tokens.device, LOAD_BALANCER)
        if not shard_positions:  # the mutant: RoPE at 0..s_r-1 on every rank, as a buffer CP never cut
            extra = {}
        ring = cpu_ring_attention()
        ring.__enter__()
        entered.append(ring)
        return (), {"tokens": tokens, **extra}

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        while entered:
            entered.pop().__exit__(None, None, None)

    return pre, post


def titan_cp_shard(build: Callable[[RankContext], nn.Module], fsdp_shims: Callable[[nn.Module], None], *,
                   shard_positions: bool = True, local_loss: Callable[..., torch.Tensor] | None = None,
                   fsdp_mean: bool = True):
    """The sharded factory of a `torchtitan_case(..., context_parallel=N)`: `build(ctx)` is this
    rank's torchtitan model (the reference's config and dtype), loaded with the reference's state,
    then torchtitan's CP path (module docstring); `fsdp_shims(model)` after its FSDP2 (torchtitan's
    `cpu_shims`). `shard_positions=False`: the positions are not handed to the model (a mutant's).
    `local_loss`: the rank's loss on its sequence shard (torchtitan_loss; None: the engine's).
    `fsdp_mean=False`: at DP > 1, FSDP's grad division left off as torchtitan sets it (a mutant's)."""

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        from torchtitan.distributed.context_parallel import apply_cp_to_forward
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend("partial_dtensor")
        model: Any = build(ctx)  # a torchtitan Decoder: its blocks in `layers`
        model.load_state_dict(reference.state_dict())
        # the engine's TP group is the CP group: 1-D ("tp",) at DP 1, the "tp" axis of ("dp", "tp")
        cp_mesh = ctx.device_mesh if ctx.dp == 1 else ctx.device_mesh["tp"]
        apply_cp_to_forward([block.attention.inner_attention for block in model.layers.values()], cp_mesh)
        dtype = ctx.config.torch_dtype
        # torchtitan's "fsdp" mesh: dp_shard x cp flattened (the CP group alone at DP 1)
        fsdp_mesh = cp_mesh if ctx.dp == 1 else ctx.device_mesh._flatten("fsdp")
        apply_fsdp_to_decoder(model, fsdp_mesh, param_dtype=dtype, reduce_dtype=dtype, pp_enabled=False)
        if ctx.dp > 1 and fsdp_mean:
            # FSDP sums over dp x cp (torchtitan turns its division off for its global-token loss);
            # the engine's replica loss is the replica's own mean, so the sum over DP is divided by
            # DP: the same grads (every replica holds equal tokens), as torchtitan_shard does
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(float(ctx.dp))
        fsdp_shims(model)
        pre, post = _cp_hooks(cp_mesh, shard_positions=shard_positions)
        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True, always_call=True)
        whole = Layout(seq_dim=1, batch_dim=0, seq_sharded=False)  # torchtitan cuts the sequence itself
        out = Layout(seq_dim=1, batch_dim=0, seq_order=headtail_order)
        return Sharded(module=model, input_layout=whole, output_layout=out, replicated=("*",), local_loss=local_loss)

    return shard


__all__ = ["CP_FLOAT64", "LOAD_BALANCER", "cp_limits", "headtail_order", "titan_cp_shard"]

