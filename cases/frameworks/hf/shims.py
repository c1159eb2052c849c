"""Stage: step. The HF Trainer's CPU shims, for its sequence-parallel path (`sp`): two torch
collectives on gloo made to do what they do on NCCL.

1. `gloo_all_to_all_by_group_rank`: a collective's gloo branch addressed by group rank, as its
   NCCL branch already is.

- What runs on CUDA: transformers' `deepspeed_sp_compute_loss` (and a user's loss written like it)
  gathers each SP rank's loss with `torch.distributed.nn.functional.all_gather`, whose backward on
  NCCL is one `reduce_scatter` over the SP group.
- What goes wrong on CPU: on gloo that backward runs `_AlltoAll`, which emulates the exchange with
  one `dist.scatter(out[i], ..., i, group=group)` per group member `i`, passing the GROUP rank `i`
  where `scatter` takes a GLOBAL source rank (torch 2.13.0, torch/distributed/nn/functional.py
  `_AlltoAll.forward`). On a group that is not ranks 0..n-1 (the second SP group of DP 2 x SP 2:
  ranks 2 and 3) it raises "Global rank 0 is not part of group"; on the first group it happens to
  work, since there group rank i is global rank i.
- The shim: the same loop, with `dist.get_global_rank(group, i)` as the source. Each member still
  scatters its list to the group and receives its slot from every member, the same tensors over
  the same group: every value is what the NCCL branch's reduce-scatter computes (the sum over the
  members of each one's grad for this rank's slot is then taken by `_AllGather.backward`, unchanged).
- NCCL and every non-gloo backend take the untouched `all_to_all` branch; the shim changes nothing
  there. Idempotent; applied by the SP step on its rank before the Trainer is built.

2. `gloo_uneven_all_gather`: `dist.all_gather` into outputs of different shapes.

- What runs on CUDA: DeepSpeed's SP data-loader adapter (`UlyssesSPDataLoaderAdapter.refill`)
  all-gathers every SP rank's batch into outputs sized by each rank's own sequence length (a
  collator that pads to the longest sequence of its batch, TRL's, gives each rank its own length).
  ProcessGroupNCCL's `allgather` takes outputs of different sizes: it runs them as one coalesced
  out-of-place broadcast per rank (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, `allgather`
  and `_broadcast_oop`, "all_gather_v").
- What goes wrong on CPU: ProcessGroupGloo's `allgather` requires every output the input's shape
  ("invalid tensor size at index 1 (expected (2, 12), got (2, 10))").
- The shim: where the group is gloo and the outputs' shapes differ, the same broadcasts NCCL
  coalesces: member i's tensor broadcast from member i into output i, in member order. Every
  output holds exactly the tensor its member sent, as on NCCL; equal shapes, async calls and
  every other backend take torch's own `all_gather`. Idempotent; applied with the first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_APPLIED: dict[str, Any] = {}


def _all_to_all_forward(ctx: Any, group: Any, out_tensor_list: list[torch.Tensor], *tensors: torch.Tensor):
    """torch 2.13.0's `_AlltoAll.forward`, with the gloo branch's scatter source a global rank."""
    ctx.group = group
    ctx.input_tensor_size_list = [tensors[i].size() for i in range(dist.get_world_size(group=group))]
    my_rank = dist.get_rank(group=group)
    tensors = tuple(t.contiguous() for t in tensors)
    if dist.get_backend(group=group) is dist.Backend.GLOO:
        for i in range(dist.get_world_size(group=group)):
            to_send = list(tensors) if i == my_rank else None
            source = i if group is None else dist.get_global_rank(group, i)
            dist.scatter(out_tensor_list[i], to_send, source, group=group)
    else:
        dist.all_to_all(out_tensor_list, list(tensors), group=group)
    return tuple(out_tensor_list)


def gloo_all_to_all_by_group_rank() -> None:
    """Apply the shim (module doc), once per process."""
    if "all_to_all" in _APPLIED:
        return
    from torch.distributed.nn import functional

    _APPLIED["all_to_all"] = functional._AlltoAll.forward
    functional._AlltoAll.forward = staticmethod(_all_to_all_forward)  # type: ignore[method-assign]


def _uneven_all_gather(original: Any) -> Any:
    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        if (async_op or dist.get_backend(group) != dist.Backend.GLOO
                or len({tuple(t.shape) for t in tensor_list}) == 1):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        me = dist.get_rank(group=group)
        for i, out in enumerate(tensor_list):
            if i == me:
                out.copy_(tensor)
            dist.broadcast(out, i if group is None else dist.get_global_rank(group, i), group=group)
        return None

    return all_gather


def gloo_uneven_all_gather() -> None:
    """Apply the second shim (module doc), once per process."""
    if "all_gather" in _APPLIED:
        return
    _APPLIED["all_gather"] = dist.all_gather
    dist.all_gather = _uneven_all_gather(dist.all_gather)


__all__ = ["gloo_all_to_all_by_group_rank", "gloo_uneven_all_gather"]
