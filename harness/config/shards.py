"""Stage: config. Shard arithmetic, pure and process-group free.

The convention everywhere is torch.chunk's, which is also DTensor's `Shard(dim)`: each of the
first ranks gets ceil(n / parts) and the last non-empty one the remainder, so 10 over 3 is
4/4/2, 32 over 3 is 11/11/10, and 5 over 4 is 2/2/1/0 (trailing ranks may be empty).
Explicit sizes (any non-negative tuple summing to n) are accepted wherever sizes are passed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chunk_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Sizes torch.chunk(n, parts) gives, padded with zeros to exactly `parts` entries."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    step = -(-n // parts)
    sizes = []
    left = n
    for _ in range(parts):
        take = min(step, left)
        sizes.append(take)
        left -= take
    return tuple(sizes)


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Start index of each shard."""
    out, acc = [], 0
    for size in sizes:
        out.append(acc)
        acc += size
    return tuple(out)


def is_even(sizes: Sequence[int]) -> bool:
    return len(set(sizes)) <= 1


def shard(tensor: torch.Tensor, dim: int, sizes: Sequence[int], index: int) -> torch.Tensor:
    """The `index`-th piece of `tensor` split on `dim` by `sizes` (a view)."""
    if sum(sizes) != tensor.shape[dim]:
        raise ValueError(
            f"shard sizes {list(sizes)} sum to {sum(sizes)}, but dim {dim} has size {tensor.shape[dim]}"
        )
    return tensor.narrow(dim, offsets(sizes)[index], sizes[index])
