"""DCNv2 (Wang et al., 2021): a cross network of explicit feature crosses next to an MLP.

::

    dense [B, F_d] ─► bottom MLP ─► x [B, D] ─┐
    sparse ─► embedding collection ─► E [B, T*D] ─► concat ─► x0 [B, (T+1)D]
                                                                  │
       stacked:   x0 ─► cross ×L ─► deep MLP (top_mlp) ─► logit [B]
       parallel:  x0 ─► cross ×L ──────────┐
                  x0 ─► deep MLP ──────────┴─► concat ─► linear ─► logit [B]

    cross layer:  x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l         W_l [N, N]
                  low rank: W_l = U_l V_l^T                    U_l, V_l [N, r]

Data without dense features has no bottom MLP: ``x0 = E [B, T*D]``.

``top_mlp`` is the deep network and ends in one logit; in the parallel
structure its last layer (the logit) becomes the final linear layer over the
concatenated cross and deep outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from towerrec.models.common import (
    check_dense_input,
    check_mlp_ends,
    count_dense_parameters,
    shared_embedding_dim,
)
from towerrec.models.interfaces import SparseArchModel
from towerrec.modules.interfaces import PooledEmbeddingCollection
from towerrec.modules.mlp import MLP
from towerrec.sparse import KeyedJaggedTensor
from towerrec.utils import at_least

__all__ = ["DCN", "CrossNetwork", "DCNConfig"]


@dataclass(frozen=True)
class DCNConfig:
    """``model.dcn``: the cross network of ``model.name = "dcn"``."""

    # 0: no cross layer, the deep MLP alone over x0 (with model.bottom_mlp = [], FuxiCTR's
    # DNN: the dense features and every embedding concatenated into one MLP)
    num_layers: int = 3
    rank: int = 0  # 0: full-rank W [N, N]; r > 0: W = U V^T with U, V [N, r]
    structure: str = "stacked"  # stacked | parallel

    def __post_init__(self) -> None:
        at_least("model.dcn.num_layers", self.num_layers, 0, hint="0 = the deep MLP alone")
        at_least("model.dcn.rank", self.rank, 0, hint="0 = full rank")
        if self.structure not in ("stacked", "parallel"):
            raise ValueError(
                f"model.dcn.structure = {self.structure!r} is not one of 'stacked', 'parallel'"
            )


class CrossNetwork(nn.Module):
    """``L`` cross layers over ``x0 [B, N]`` -> ``[B, N]`` (full or low-rank W)."""

    def __init__(self, in_features: int, num_layers: int, rank: int = 0) -> None:
        super().__init__()
        self.in_features, self.rank = in_features, rank
        if rank:
            self.down = nn.ModuleList(
                nn.Linear(in_features, rank, bias=False) for _ in range(num_layers)
            )
            self.up = nn.ModuleList(nn.Linear(rank, in_features) for _ in range(num_layers))
        else:
            self.up = nn.ModuleList(nn.Linear(in_features, in_features) for _ in range(num_layers))
            self.down = nn.ModuleList(nn.Identity() for _ in range(num_layers))

    def flops_per_sample(self) -> int:
        n, layers = self.in_features, len(self.up)
        matmul = 4 * n * self.rank if self.rank else 2 * n * n
        return layers * (matmul + 3 * n)  # + bias, product with x0, residual

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return x


class DCN(SparseArchModel):
    """DCNv2 over an embedding collection whose features all have one dim D."""

    def __init__(
        self,
        sparse: PooledEmbeddingCollection,
        num_dense: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        config: DCNConfig | None = None,
        *,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        config = config or DCNConfig()
        dim = shared_embedding_dim(sparse, "DCN")
        check_dense_input(num_dense, bottom_mlp, raw_ok=True)
        check_mlp_ends(bottom_mlp, top_mlp, dim, f"the embedding dim {dim}")
        self.config = config
        self.sparse = sparse
        self.embedding_dim = dim
        self.num_sparse = len(sparse.feature_names)
        # x0 = [bottom(dense) (dim wide) or, with bottom_mlp = [], the dense features as
        # they are (num_dense wide), E (num_sparse x dim)]
        self.raw_dense = num_dense > 0 and not bottom_mlp
        width = dim * self.num_sparse + (num_dense if self.raw_dense else dim * (num_dense > 0))
        mlp = partial(MLP, dropout=dropout, batch_norm=batch_norm)
        self.bottom = mlp(num_dense, bottom_mlp) if num_dense and bottom_mlp else None
        self.cross = CrossNetwork(width, config.num_layers, config.rank)
        if config.structure == "stacked":
            self.deep: MLP | None = mlp(width, top_mlp, final_activation=False)
            self.head = None
        else:
            hidden = list(top_mlp[:-1])
            self.deep = mlp(width, hidden) if hidden else None
            deep_out = hidden[-1] if hidden else 0
            self.head = nn.Linear(width + deep_out, 1)

    def num_dense_parameters(self) -> int:
        """Parameters that the dense optimizer owns."""
        return count_dense_parameters(self)

    def flops_per_sample(self) -> int:
        """Forward FLOPs of the dense part per sample."""
        flops = self.cross.flops_per_sample()
        flops += self.bottom.flops_per_sample() if self.bottom is not None else 0
        flops += self.deep.flops_per_sample() if self.deep is not None else 0
        if self.head is not None:
            flops += 2 * self.head.in_features
        return flops + self.sparse.flops_per_sample()

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        embeddings = self.sparse(sparse).values()
        if self.bottom is not None:
            x0 = torch.cat([self.bottom(dense), embeddings], 1)
        elif self.raw_dense:
            x0 = torch.cat([dense, embeddings], 1)
        else:
            x0 = embeddings
        crossed = self.cross(x0)
        if self.head is None:
            assert self.deep is not None  # stacked: the deep MLP ends in the logit
            return self.deep(crossed).squeeze(1)
        parts = [crossed] if self.deep is None else [crossed, self.deep(x0)]
        return self.head(torch.cat(parts, dim=1)).squeeze(1)
