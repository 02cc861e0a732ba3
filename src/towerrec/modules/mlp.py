"""Multi-layer perceptron."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Sequential):
    """``in_features -> layer_sizes[0] -> ... -> layer_sizes[-1]``, ReLU between layers.

    ``final_activation=False`` leaves the last layer linear (a logit head).
    """

    def __init__(
        self, in_features: int, layer_sizes: Sequence[int], *, final_activation: bool = True
    ) -> None:
        if not layer_sizes:
            raise ValueError("an MLP needs at least one layer size")
        if any(s < 1 for s in layer_sizes):
            raise ValueError(f"MLP layer sizes must be >= 1, got {list(layer_sizes)}")
        layers: list[nn.Module] = []
        width = in_features
        for i, size in enumerate(layer_sizes):
            layers.append(nn.Linear(width, size))
            if final_activation or i < len(layer_sizes) - 1:
                layers.append(nn.ReLU())
            width = size
        super().__init__(*layers)
        self.in_features = in_features
        self.out_features = width

    def flops_per_sample(self) -> int:
        """Multiply-adds x2 of the forward pass, per sample."""
        return sum(2 * m.in_features * m.out_features for m in self if isinstance(m, nn.Linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)
