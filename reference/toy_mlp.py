"""The seed's ToyModel: Linear(in, hidden) -> ReLU -> Linear(hidden, out).

Stage: step. Widths are configurable; the seed uses 10 -> 32 -> 5.
"""

from __future__ import annotations

import torch
from torch import nn


class ToyModel(nn.Module):
    """MLP based model, exactly the seed's structure and parameter names."""

    def __init__(self, in_features: int = 10, hidden: int = 32, out_features: int = 5):
        super().__init__()
        self.in_proj = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (S, in) or (B, S, in)
        return self.out_proj(self.relu(self.in_proj(x)))  # (..., out)
