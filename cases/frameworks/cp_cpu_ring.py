"""Stage: step. An opt-in CPU shim for torch's context-parallel ring attention: while
`cpu_ring_attention()` is active, the CPU flash SDPA op on sequence-sharded DTensors runs
through torch's OWN ring code, as the CUDA flash op does.

    from sp_harness.cases.frameworks.cp_cpu_ring import cpu_ring_attention
    with cpu_ring_attention():
        out = model(tokens)          # q/k/v DTensors Shard(2) on a 1-D CP mesh: ring attention
    out.sum().backward()             # its backward: torch's ring backward too

What CUDA does (torch 2.13.0, `torch.distributed.tensor.experimental._context_parallel._attention`):
`F.scaled_dot_product_attention` on q/k/v DTensors `Shard(2)` dispatches
`aten._scaled_dot_product_flash_attention` (or the efficient / cuDNN op), whose DTensor handler
(`custom_ops` -> `_sdpa_handler`, installed by `_enable_context_parallel_dispatcher`, which
torchtitan's `apply_cp_to_forward` calls) runs `_templated_ring_attention(group, 2, op, q, k, v,
is_causal=...)`: per KV block the flash kernel returns (out, logsumexp), torch's `_SDPAMerger`
merges the blocks by their LSEs (in float32, `_cp_options.convert_to_f32`), its rotater passes
K/V round the CP group, and its head-tail branches skip or halve the causal blocks when the load
balancer is on. The backward op goes through `_templated_ring_attention_backward` with the flash
backward kernel per block and torch's rotation of K/V and of their grads.

What the CPU lacks: SDPA on CPU dispatches `aten._scaled_dot_product_flash_attention_for_cpu`
(and `..._for_cpu_backward`), which are not in `custom_ops`, so DTensor looks for a sharding
strategy and raises `NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered` (tests/test_torch_cp.py pins it).

What the shim changes, and only that: it adds a DTensor handler for those two CPU ops which calls
the same `_templated_ring_attention` / `_templated_ring_attention_backward` with the CPU op as the
per-block kernel. The CPU forward op returns (out, logsumexp), the first two of the CUDA flash
op's nine outputs and the only two the ring reads (`out, logsumexp, *rest = op(...)`; `rest`
is then empty, so the handler returns the pair, the CPU op's own output arity); its backward
takes the same named arguments the ring passes (grad_out, query, key, value, out, logsumexp,
is_causal, dropout_p, scale) and returns (grad_query, grad_key, grad_value), the CUDA backward's
first three. Outputs are wrapped `Shard(2)` on the inputs' mesh, the placement torch's CP
strategy gives the CUDA op's out and logsumexp.

Why the math is unchanged: the ring, the LSE merge, the load-balanced skipping, the K/V and
grad rotation and their dtypes are torch's own code, called with the arguments `_sdpa_handler`
gives them; each block's attention and LSE are the CPU flash kernel's, which computes the same
softmax(q k^T * scale) v and log-sum-exp per query row (causal within a block) as the CUDA flash
kernel, to the rounding of a different kernel.

Opt-in: on first entry the two handlers are added to DTensor's custom-op table (re-added on
each entry, since torchtitan's `_enable_context_parallel_dispatcher` rebuilds that table) and
then left there inert. The forward handler rings only while a `cpu_ring_attention()` block is
active; the backward handler rings only for an op whose logsumexp the forward handler made
(marked on the local tensor, which autograd saves and hands back as the same object). Anything
else, and any placement other than `Shard(2)` on a 1-D mesh, goes on to torch's own dispatch
unchanged: outside the block DTensor behaves exactly as without the shim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

aten = torch.ops.aten
_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SEQ_DIM = 2
"""(B, H, S, D): the dim torch's ring rotates and its CP strategy shards (`_sharding_rules.SEQ_DIM`)."""
_MARK = "_sp_harness_cpu_ring_lse"
_active = 0


def _ring_placed(args: tuple[Any, ...]) -> bool:
    """Every DTensor argument `Shard(2)` on one 1-D mesh: what torch's CP strategy accepts."""
    dts = [a for a in args if isinstance(a, DTensor)]
    return bool(dts) and all(a.device_mesh.ndim == 1 and tuple(a.placements) == (Shard(_SEQ_DIM),)
                             and a.device_mesh == dts[0].device_mesh for a in dts)


def _torchs_own(op_call, handler, args, kwargs):
    """The op dispatched as without the shim: this handler out of the table for the call."""
    table = DTensor._op_dispatcher._custom_op_handlers
    table.pop(op_call, None)
    try:
        return op_call(*args, **kwargs)
    finally:
        table[op_call] = handler


def _wrap(local: torch.Tensor, like: DTensor) -> DTensor:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    placements = (Shard(_SEQ_DIM),)
    shape, stride = compute_global_tensor_info(local, like.device_mesh, placements)
    spec = DTensorSpec(like.device_mesh, placements, TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _forward_handler(op_call, args, kwargs):
    if not _active or not _ring_placed(args):
        return _torchs_own(op_call, _forward_handler, args, kwargs)
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    bound = _bind(op_call, args, kwargs)
    query = bound["query"]
    if bound.get("attn_mask") is not None:
        raise NotImplementedError("cpu_ring_attention: attn_mask is not supported (torch's CP ring takes none)")
    out, lse = _templated_ring_attention(
        query.device_mesh.get_group(), _SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
        query=query.to_local(), key=bound["key"].to_local(), value=bound["value"].to_local(),
        is_causal=bound.get("is_causal", False), dropout_p=bound.get("dropout_p", 0.0), scale=bound.get("scale"))
    setattr(lse, _MARK, True)
    return _wrap(out, query), _wrap(lse, query)


def _backward_handler(op_call, args, kwargs):
    bound = _bind(op_call, args, kwargs)
    lse = bound["logsumexp"]
    if not (isinstance(lse, DTensor) and getattr(lse.to_local(), _MARK, False) and _ring_placed(args)):
        return _torchs_own(op_call, _backward_handler, args, kwargs)
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    local = {name: (v.to_local() if isinstance(v, DTensor) else v) for name, v in bound.items()}
    query = bound["query"]
    grads = _templated_ring_attention_backward(
        query.device_mesh.get_group(), _SEQ_DIM, _BACKWARD, grad_out=local["grad_out"], grad_out_name="grad_out",
        query=local["query"], key=local["key"], value=local["value"], out=local["out"],
        logsumexp=local["logsumexp"], is_causal=local["is_causal"], dropout_p=local["dropout_p"],
        scale=local.get("scale"))
    return tuple(_wrap(g, query) for g in grads)


def _bind(op_call, args, kwargs) -> dict[str, Any]:
    """The op's arguments by their schema names (defaults filled in)."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(op_call._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _install() -> None:
    table = DTensor._op_dispatcher._custom_op_handlers
    table[_FORWARD] = _forward_handler
    table[_BACKWARD] = _backward_handler


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """While active, CPU flash SDPA on q/k/v DTensors `Shard(2)` over a 1-D mesh is torch's ring
    attention (its backward too, whenever it runs). Re-entrant."""
    global _active
    _install()
    _active += 1
    try:
        yield
    finally:
        _active -= 1


__all__ = ["cpu_ring_attention"]
