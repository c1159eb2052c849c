"""Stage: step. One buffer of uniform noise shared by a job's rounding models: the perturbed
reference's (sp_harness.step.rounding) and the reorder adversary's (sp_harness.step.adversary).
"""

from __future__ import annotations

import functools
import math

import torch


class NoisePool:
    """Uniform [-1, 1] noise for a whole job from one buffer drawn once: each request is a window
    of the buffer at a random offset (wrapping). Drawing fresh numbers for every element of every
    op made the perturbed reference cost more than the model it checks (torch.rand on the CPU is
    one thread); a window is one copy. Within a request the values are distinct draws; across
    requests windows may overlap, at offsets unrelated to what the ops compute.

    The buffer repeats its first TAIL values after its end, so a window of up to TAIL values
    wraps without a copy: a view, where cutting and concatenating two pieces cost a pass.

    The values (and their derived factors and casts) are drawn once per process from a fixed
    seed and shared by every pool of that size: only the window offsets come from `gen`, so a
    job's noise is still a function of its own seed alone, never of the jobs before it, and a
    warm pool's example no longer pays 4M random draws (a third of a small check's time)."""

    SIZE = 1 << 22
    TAIL = 1 << 20

    def __init__(self, gen: torch.Generator, size: int = SIZE, tail: int = TAIL):
        self.gen, self.size = gen, size
        self.values = _shared_values(size, tail)
        self._factors: dict[float, torch.Tensor] = _SHARED_DERIVED.setdefault((size, tail, "factors"), {})
        """rel -> 1 + rel * values, made on first use: a perturbation is then one multiply by a
        window of it (bit for bit what scaling a window of `values` computes), not three passes."""
        self._typed: dict[torch.dtype, torch.Tensor] = _SHARED_DERIVED.setdefault((size, tail, "typed"), {})
        """The values in another dtype (float32 for a float32 run's order noise), made on first
        use: a window is then a view, not a cast of every element."""
        self._offsets: list[int] = []
        """Window offsets drawn OFFSETS at a time: one randint per window was a third of the
        perturbed reference's Python time at small sizes. `forget_offsets` drops them, for a
        caller that reseeds `gen` and needs the windows to follow the new seed alone."""

    OFFSETS = 256

    def forget_offsets(self) -> None:
        self._offsets.clear()

    def _offset(self) -> int:
        if not self._offsets:
            self._offsets = torch.randint(self.size, (self.OFFSETS,), generator=self.gen).tolist()[::-1]
        return self._offsets.pop()

    def window(self, shape: torch.Size, dtype: torch.dtype, device: torch.device,
               values: torch.Tensor | None = None) -> torch.Tensor:
        if values is None:
            values = self.values
            if dtype != values.dtype and dtype.is_floating_point:
                if dtype not in self._typed:
                    self._typed[dtype] = values.to(dtype)
                values = self._typed[dtype]
        numel, size, end = math.prod(shape), self.size, values.numel()
        pieces, left = [], numel
        while left:
            start = self._offset()
            take = min(left, size, end - start)  # at most `size`: distinct draws within a piece
            pieces.append(values[start:start + take])
            left -= take
        # an empty request (a matmul on a rank holding no tokens) draws nothing
        flat = values[:0] if not pieces else pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if flat.dtype != dtype or flat.device != device:
            flat = flat.to(device=device, dtype=dtype)
        return flat.view(shape)

    def factor_window(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, rel: float) -> torch.Tensor:
        """A window of (1 + rel u): the same offsets a `window` call would draw, so the same noise."""
        if dtype != self.values.dtype:
            # the factor rounds in the tensor's own dtype, as `window(...) * rel + 1` would
            factor = self.window(shape, dtype, device) * rel
            return factor.add_(1)
        if rel not in self._factors:
            self._factors[rel] = self.values * rel + 1
        return self.window(shape, dtype, device, self._factors[rel])


VALUES_SEED = 0x5EED
"""The noise buffers' values come from this seed (their offsets from each job's generator)."""
_SHARED_DERIVED: dict[tuple, dict] = {}
"""Per (size, tail): the buffer's factors by rel and casts by dtype, made on first use."""


@functools.cache
def _shared_values(size: int, tail: int) -> torch.Tensor:
    """Uniform [-1, 1] float64, `size` values then their first `tail` again (see NoisePool)."""
    values = torch.rand(size, generator=torch.Generator().manual_seed(VALUES_SEED), dtype=torch.float64) * 2 - 1
    return torch.cat([values, values[:tail]])
