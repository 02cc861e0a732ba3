"""Feature interactions over stacked embeddings ``[B, F, D]``."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DotInteraction"]


class DotInteraction(nn.Module):
    """Pairwise dot products of F vectors: the upper triangle of ``X X^T``.

    ``[B, F, D] -> [B, F(F-1)/2]`` (``[B, F(F+1)/2]`` with ``self_interaction``),
    pairs in row-major order (0,1), (0,2), ..., (1,2), ...; one batched matmul
    and one gather.
    """

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

    @property
    def out_features(self) -> int:
        return self.flat_index.numel()

    def flops_per_sample(self, dim: int) -> int:
        return 2 * self.num_features * self.num_features * dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        gram = torch.bmm(x, x.transpose(1, 2))
        return gram.view(batch, -1).index_select(1, self.flat_index)
