"""Multi-layer perceptron.

A linear layer of 64 inputs or more whose width is not a multiple of 8 (a DLRM
top MLP over 16 + 351 interaction outputs) runs its matmuls on operands
zero-padded to the next multiple of 8: row strides that are not a multiple of
the vector width slow the BLAS kernels by up to 1.5x on CPU (docs/benchmarks.md,
speed notes). The zeros add nothing to the result; the weight keeps its shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "aligned_linear", "padded_linear", "padding_for"]

ALIGN = 8


MIN_PADDED = 64


def padding_for(in_features: int) -> int:
    """Zero columns that take ``in_features`` to a multiple of 8; 0 below 64 inputs,
    where the extra columns would add up to 2x work to a layer that costs little."""
    if in_features < MIN_PADDED:
        return 0
    return -in_features % ALIGN


def aligned_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` for ``x`` of ``[B, in]``, or ``[B, in + padding_for(in)]`` whose
    last columns are already zero; the matmul runs on 8-aligned operands."""
    return padded_linear(x, layer.weight, layer.bias)


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``aligned_linear`` for a weight ``[out, in]`` that need not be a layer's own (a
    block of a supernet's weight computes exactly what a layer of that shape does)."""
    in_features = weight.shape[1]
    pad = padding_for(in_features)
    if pad == 0:
        return F.linear(x, weight, bias)
    if x.shape[-1] == in_features:
        x = F.pad(x, (0, pad))
    return F.linear(x, F.pad(weight, (0, pad)), bias)


class MLP(nn.Sequential):
    """``in_features -> layer_sizes[0] -> ... -> layer_sizes[-1]``, ReLU between layers.

    ``final_activation=False`` leaves the last layer linear (a logit head).
    Every layer with a ReLU gets, with ``batch_norm``, a ``BatchNorm1d`` between
    its linear map and the ReLU, and with ``dropout > 0`` dropout after the ReLU
    in training mode (a function in ``forward``, not a module: a model's
    ``state_dict`` names do not depend on it); a linear head gets neither. At
    the defaults the MLP is the plain one, module for module.
    ``forward`` takes ``[B, in_features]``, or ``[B, in_features + input_padding]``
    with zeros in the last ``input_padding`` columns (a caller that concatenates
    its input anyway appends them there and saves a copy).
    """

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        *,
        final_activation: bool = True,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        if not layer_sizes:
            raise ValueError("an MLP needs at least one layer size")
        if any(s < 1 for s in layer_sizes):
            raise ValueError(f"MLP layer sizes must be >= 1, got {list(layer_sizes)}")
        if not 0 <= dropout < 1:
            raise ValueError(f"MLP dropout must lie in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        width = in_features
        for i, size in enumerate(layer_sizes):
            layers.append(nn.Linear(width, size))
            if final_activation or i < len(layer_sizes) - 1:
                if batch_norm:
                    layers.append(nn.BatchNorm1d(size))
                layers.append(nn.ReLU())
            width = size
        super().__init__(*layers)
        self.in_features = in_features
        self.out_features = width
        self.input_padding = padding_for(in_features)
        self.dropout, self.batch_norm = dropout, batch_norm

    def flops_per_sample(self) -> int:
        """Multiply-adds x2 of the linear layers' forward pass, per sample (batch norm
        and dropout are elementwise and left out, as torch's FlopCounterMode does)."""
        return sum(2 * m.in_features * m.out_features for m in self if isinstance(m, nn.Linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            if isinstance(layer, nn.Linear):
                x = aligned_linear(x, layer)
            elif isinstance(layer, nn.ReLU):
                x = torch.relu_(x)  # in place on the fresh linear output: one buffer less
                if self.dropout and self.training:
                    x = F.dropout(x, self.dropout)
            else:
                x = layer(x)
        return x
