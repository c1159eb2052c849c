"""Stage: config. What a sharded factory knows about the rank it runs on.

The engine builds one `RankContext` per job on every rank and hands it to `Case.shard` (and to a
reference factory that takes a second argument): the rank's place in the DP x TP mesh, its
process groups, and the per-process caches (`new_groups`, `once`) that a warm pool's later jobs
reuse, since a collective group or a framework's global state must not be made twice.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sp_harness.config.check_config import CheckConfig

_NEW_GROUPS: dict[tuple, dict[tuple[int, ...], Any]] = {}
"""Groups made by `RankContext.new_groups` in this process, by (world size, partition)."""
_ONCE: dict[Hashable, Any] = {}
"""Results of `RankContext.once` in this process, by key."""


@dataclass
class RankContext:
    """What a sharded factory knows about the rank it runs on. Built by the engine."""

    config: CheckConfig
    rank: int
    world_size: int
    dp_rank: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    seq_shards: tuple[int, ...]
    """Tokens per TP rank for this config (explicit or torch.chunk's)."""
    device: torch.device
    _mesh: Any = None
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """Named process groups: "tp", also named "sp" and "cp" (the group the sequence is sharded
    over), "dp", "world", and each one made by `new_groups`."""
    _group_names: dict[tuple[int, ...], str] = field(default_factory=dict)

    def new_groups(self, name: str, partition: Sequence[Sequence[int]]) -> dist.ProcessGroup:
        """This rank's group of `partition` (every rank's tuple of ranks, covering each rank once),
        recorded as `groups[name]`. Every rank must call it with the same partition: each creates
        every group of it, in order (`new_group` is a collective of the whole world). Created once
        per rank process: a warm pool's later jobs get the same groups back."""
        blocks = tuple(tuple(int(r) for r in block) for block in partition)
        flat = sorted(r for block in blocks for r in block)
        if flat != list(range(self.world_size)) or any(not block for block in blocks):
            raise ValueError(f"new_groups({name!r}): {[list(b) for b in blocks]} is not a partition of the ranks "
                             f"0..{self.world_size - 1} (each rank in exactly one non-empty group)")
        key = (self.world_size, blocks)
        if key not in _NEW_GROUPS:
            made = [dist.group.WORLD if len(b) == self.world_size else dist.new_group(list(b)) for b in blocks]
            _NEW_GROUPS[key] = dict(zip(blocks, made, strict=True))
        ranks = next(b for b in blocks if self.rank in b)
        self.groups[name] = _NEW_GROUPS[key][ranks]
        self._group_names.setdefault(ranks, name)
        return self.groups[name]

    def once(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """`fn()`, run once per rank process for `key` and cached: a framework's global state
        (megatron's `initialize_model_parallel`) that must not be set up twice on a warm pool.
        The key names what the result depends on (the mesh, say)."""
        if key not in _ONCE:
            _ONCE[key] = fn()
        return _ONCE[key]

    @property
    def tp(self) -> int:
        return len(self.tp_ranks)

    @property
    def dp(self) -> int:
        return len(self.dp_ranks)

    @property
    def device_mesh(self):
        """A DTensor DeviceMesh: 1-D ("tp",) when dp == 1, else 2-D ("dp", "tp")."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            if self.dp == 1:
                self._mesh = init_device_mesh(self.device.type, (self.tp,), mesh_dim_names=("tp",))
            else:
                self._mesh = init_device_mesh(
                    self.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp")
                )
        return self._mesh

    def group_label(self, ranks: tuple[int, ...]) -> str:
        """Human name of a process group by its ranks, for collective accounting."""
        if ranks == self.tp_ranks:
            return "tp"
        if ranks == self.dp_ranks:
            return "dp"
        if ranks in self._group_names:
            return self._group_names[ranks]
        if len(ranks) == self.world_size:
            return "world"
        return "ranks" + "-".join(map(str, ranks))
