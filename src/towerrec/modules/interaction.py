"""Feature interactions over stacked embeddings ``[B, F, D]``.

::

    X [B, F, D] ──► G = X X^T [B, F, F] (one bmm) ──► upper triangle [B, P]
                                                      (one gather, row-major pairs)
    backward: grad [B, P] ──► S [B, F, F]: S[i,j] = S[j,i] = grad of pair (i,j)
              (one gather) ──► grad X = S X (one bmm, instead of two and a sum)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DotInteraction"]


def _columns(matrix: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``matrix[:, index]`` as one gather over an expanded index: the same values as
    ``index_select(1, index)``, 3x faster on CPU in bf16 (whose ``index_select`` along the
    second dimension takes a slow path) and no slower in fp32."""
    return torch.gather(matrix, 1, index.expand(matrix.shape[0], -1))


class _PairwiseDots(torch.autograd.Function):
    """Upper triangle of ``X X^T`` with a one-bmm backward (module picture)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        flat_index: torch.Tensor,
        pair_of_position: torch.Tensor,
        self_interaction: bool,
    ) -> torch.Tensor:
        batch, features, _ = x.shape
        ctx.save_for_backward(x, pair_of_position)
        ctx.self_interaction = self_interaction
        gram = torch.bmm(x, x.transpose(1, 2))
        return _columns(gram.view(batch, features * features), flat_index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x, pair_of_position = ctx.saved_tensors
        batch, features, _ = x.shape
        # S[i, j] = S[j, i] = grad of pair (i, j), 0 (the appended column) where
        # no pair is: one gather of contiguous rows.
        padded = torch.nn.functional.pad(grad, (0, 1))
        symmetric = _columns(padded, pair_of_position).view(batch, features, features)
        if ctx.self_interaction:  # d(x_i . x_i)/dx_i = 2 x_i
            symmetric.diagonal(dim1=1, dim2=2).mul_(2)
        return torch.bmm(symmetric, x.to(symmetric.dtype)), None, None, None


class DotInteraction(nn.Module):
    """Pairwise dot products of F vectors: the upper triangle of ``X X^T``.

    ``[B, F, D] -> [B, F(F-1)/2]`` (``[B, F(F+1)/2]`` with ``self_interaction``),
    pairs in row-major order (0,1), (0,2), ..., (1,2), ...; one batched matmul
    and one gather forward, one batched matmul backward.
    """

    flat_index: torch.Tensor
    pair_of_position: torch.Tensor

    def __init__(self, num_features: int, self_interaction: bool = False) -> None:
        super().__init__()
        if num_features < 2 and not self_interaction:
            raise ValueError("dot interaction needs at least 2 features (or self_interaction)")
        self.num_features = num_features
        self.self_interaction = self_interaction
        rows, cols = torch.triu_indices(
            num_features, num_features, offset=0 if self_interaction else 1
        )
        self.register_buffer("flat_index", rows * num_features + cols, persistent=False)
        # For backward: position (i, j) of the F x F grid -> its pair, or the
        # number of pairs (a zero column) on the diagonal without self pairs.
        pairs = torch.arange(rows.numel())
        pair_of_position = torch.full((num_features * num_features,), rows.numel())
        pair_of_position[rows * num_features + cols] = pairs
        pair_of_position[cols * num_features + rows] = pairs
        self.register_buffer("pair_of_position", pair_of_position, persistent=False)

    @property
    def out_features(self) -> int:
        return self.flat_index.numel()

    def flops_per_sample(self, dim: int) -> int:
        return 2 * self.num_features * self.num_features * dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return _PairwiseDots.apply(x, self.flat_index, self.pair_of_position, self.self_interaction)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves Function.apply untyped
