"""Stage: capture. Collective accounting: count and bytes per collective kind, group and phase.

Every collective counted is also announced to the pool's driver before it is issued
(sp_harness.launch.announce), which compares the ranks' sequences to catch a desync in seconds.

A TorchDispatchMode sees both the raw `torch.distributed` calls of hand-written layers (the
`c10d.*` ops behind `dist.all_reduce` and friends) and DTensor's functional collectives
(`_c10d_functional.*`). Like DTensor's CommDebugMode it steps aside for DTensor arguments, so
DTensor desugars into local ops and collectives first and the mode sees those.

Bytes are payload bytes of the full (unsharded) tensor: the all-reduce's input, the all-gather's
output, the reduce-scatter's input (sp_harness.compare.comm_volume turns them into ring volume).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from sp_harness.launch import announce

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

# op name -> (kind, which argument carries the payload, how to size it)
_RAW = {
    "c10d.allreduce_.default": ("all_reduce", "list0"),
    "c10d.allreduce_coalesced_.default": ("all_reduce", "list0"),
    "c10d._allgather_base_.default": ("all_gather", "arg0"),
    "c10d.allgather_.default": ("all_gather", "listlist0"),
    "c10d.allgather_into_tensor_coalesced_.default": ("all_gather", "list0"),
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", "arg1"),
    "c10d.reduce_scatter_.default": ("reduce_scatter", "listlist1"),
    "c10d.reduce_scatter_tensor_coalesced_.default": ("reduce_scatter", "list1"),
    "c10d.broadcast_.default": ("broadcast", "list0"),
    "c10d.alltoall_base_.default": ("all_to_all", "arg1"),
    "c10d.alltoall_.default": ("all_to_all", "list1"),
    "c10d.gather_.default": ("gather", "list1"),
    "c10d.scatter_.default": ("scatter", "list0"),
    "c10d.reduce_.default": ("reduce", "list0"),
    "c10d.send.default": ("send", "list0"),
    "c10d.recv_.default": ("recv", "list0"),
}
_FUNCTIONAL = {
    "_c10d_functional.all_reduce.default": "all_reduce",
    "_c10d_functional.all_reduce_.default": "all_reduce",
    "_c10d_functional.all_reduce_coalesced.default": "all_reduce",
    "_c10d_functional.all_gather_into_tensor.default": "all_gather",
    "_c10d_functional.all_gather_into_tensor_out.default": "all_gather",
    "_c10d_functional.reduce_scatter_tensor.default": "reduce_scatter",
    "_c10d_functional.all_to_all_single.default": "all_to_all",
    "_c10d_functional.broadcast.default": "broadcast",
}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _group_ranks(group) -> tuple[int, ...]:
    try:
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(cast("GroupName", group))
        elif isinstance(group, torch.ScriptObject):
            # raw c10d ops carry the group boxed as a TorchBind object
            group = dist.ProcessGroup.unbox(group)
        return tuple(dist.get_process_group_ranks(group))
    except Exception:
        return ()


@dataclass
class CommStat:
    count: int = 0
    bytes: int = 0


@dataclass(kw_only=True, frozen=True)
class CommRow:
    """Collectives of one kind on one group in one phase of a step, as one rank issued them."""

    phase: str
    """'forward', 'backward', 'grad_sync' or 'optimizer'."""
    kind: str
    """'all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'send', ..."""
    group: str
    """'tp', 'dp', 'world', a name given to RankContext.new_groups, or 'ranks0-2' (RankContext.group_label)."""
    count: int
    bytes: int
    """Payload bytes of the full tensors (see the module docstring)."""


class CommCounter(TorchDispatchMode):
    """Counts collectives by (phase, kind, group label). Set `phase` between regions."""

    supports_higher_order_operators = True
    """A higher-order op (torch's `flex_attention`) passes through: it issues no collective, and
    without this torch raises NotImplementedError for it under any mode."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile (torchtitan compiles flex_attention) refuses to trace under a mode that
        does not ignore compile internals; the compiled graph's ops still run under this one."""
        return True

    def __init__(self, group_label: Callable[[tuple[int, ...]], str] = lambda ranks: "ranks" + "-".join(map(str, ranks))
                 ) -> None:
        super().__init__()
        self.group_label = group_label
        self.phase = "forward"
        self.stats: dict[tuple[str, str, str], CommStat] = defaultdict(CommStat)
        self._labels: dict[tuple[int, ...], str] = {}

    def _label(self, ranks: tuple[int, ...]) -> str:
        if ranks not in self._labels:
            self._labels[ranks] = self.group_label(ranks) if ranks else "unknown"
        return self._labels[ranks]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented
        name = str(func)
        if name.startswith("c10d.") and name in _RAW:
            kind, where = _RAW[name]
            idx = int(where[-1])
            payload = args[idx]
            size = _nbytes(payload)
            group = next((a for a in args if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))), None)
            self._add(kind, group, size)
        elif name.startswith("_c10d_functional.") and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            size = _nbytes(args[0])
            group = args[-1]
            if kind == "all_gather":
                size *= args[1]  # group_size: payload is the gathered output
            self._add(kind, group, size)
        return func(*args, **kwargs)

    def _add(self, kind: str, group, size: int) -> None:
        ranks = _group_ranks(group)
        # before the collective is issued: a rank that blocks in it has said where (desync detection)
        announce.collective(kind, size, ranks)
        stat = self.stats[(self.phase, kind, self._label(ranks))]
        stat.count += 1
        stat.bytes += size

    def snapshot(self) -> list[CommRow]:
        return [CommRow(phase=p, kind=k, group=g, count=s.count, bytes=s.bytes)
                for (p, k, g), s in sorted(self.stats.items())]
