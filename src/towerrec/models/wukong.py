"""Wukong (Zhang et al., 2024): a stack of factorization-machine blocks over embeddings.

::

    dense [B, F_d] ─► bottom MLP ─► [B, n_d*D] ─► reshape [B, n_d, D] ─┐
    sparse ─► embedding collection ─► E [B, T, D] ──────────────────────┴► X0 [B, n, D]
                                                                            n = n_d + T
    layer i (X_i [B, n_i, D] ─► X_{i+1} [B, n_F + n_L, D]):

        X_i ─┬─► FMB: FM(X) = X (X^T Y)  [B, n_i, k] ─► flatten ─► LayerNorm ─► MLP
             │        ─► reshape [B, n_F, D]                      Y [n_i, k] learned
             ├─► LCB: W X                [B, n_L, D]               W [n_L, n_i] learned
             │                      concat ─► [B, n_F + n_L, D] ─┐
             └─► residual (X_i, or P X_i when n_i != n_F + n_L) ─┴─► + ─► LayerNorm(D)

    X_l ─► flatten [B, n_l*D] ─► top MLP ─► logit [B]

Data without dense features has no bottom MLP: ``X0 = E`` (n = T).

The optimized FM ``X (X^T Y)`` costs ``4 n k D`` FLOPs instead of ``2 n^2 D``
for the full ``X X^T``, and its output size (n k) does not grow with n^2.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import cast

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

__all__ = ["Wukong", "WukongConfig", "WukongLayer"]


@dataclass(frozen=True)
class WukongConfig:
    """``model.wukong``: the interaction stack of ``model.name = "wukong"``.

    ``num_fm`` (n_F) and ``num_lcb`` (n_L) are the embeddings each layer emits
    from its FM block and its linear compression block; ``fm_rank`` (k) is the
    width of Y; ``fm_mlp`` the hidden widths of the FM block's MLP;
    ``dense_rows`` (n_d) the embeddings the bottom MLP makes of the dense
    features (the bottom MLP ends at ``dense_rows * embedding_dim``).
    """

    num_layers: int = 2
    num_fm: int = 8
    num_lcb: int = 8
    fm_rank: int = 8
    fm_mlp: tuple[int, ...] = (64,)
    dense_rows: int = 1

    def __post_init__(self) -> None:
        for key in ("num_layers", "fm_rank", "dense_rows"):
            at_least(f"model.wukong.{key}", getattr(self, key), 1)
        if self.num_fm < 0 or self.num_lcb < 0 or self.num_fm + self.num_lcb < 1:
            raise ValueError(
                "model.wukong.num_fm and num_lcb must be >= 0 with a positive sum, got "
                f"{self.num_fm} and {self.num_lcb}"
            )
        if any(w < 1 for w in self.fm_mlp):
            raise ValueError(f"model.wukong.fm_mlp widths must be >= 1, got {list(self.fm_mlp)}")
        object.__setattr__(self, "fm_mlp", tuple(self.fm_mlp))


class WukongLayer(nn.Module):
    """``[B, n_in, D] -> [B, num_fm + num_lcb, D]`` (see module docstring)."""

    def __init__(
        self,
        num_in: int,
        dim: int,
        num_fm: int,
        num_lcb: int,
        fm_rank: int,
        fm_mlp: Sequence[int],
        *,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.num_in, self.dim, self.num_fm, self.num_lcb = num_in, dim, num_fm, num_lcb
        self.num_out = num_fm + num_lcb
        self.fm_rank = fm_rank
        if num_fm:
            self.fm_y = nn.Parameter(torch.randn(num_in, fm_rank) / num_in**0.5)
            self.fm_norm = nn.LayerNorm(num_in * fm_rank)
            self.fm_mlp = MLP(
                num_in * fm_rank,
                [*fm_mlp, num_fm * dim],
                final_activation=False,
                dropout=dropout,
                batch_norm=batch_norm,
            )
        if num_lcb:
            self.lcb = nn.Parameter(torch.randn(num_lcb, num_in) / num_in**0.5)
        self.residual = (
            nn.Parameter(torch.randn(self.num_out, num_in) / num_in**0.5)
            if num_in != self.num_out
            else None
        )
        self.norm = nn.LayerNorm(dim)

    def flops_per_sample(self) -> int:
        n, d = self.num_in, self.dim
        flops = 0
        if self.num_fm:
            flops += 4 * n * d * self.fm_rank + self.fm_mlp.flops_per_sample()
        flops += 2 * self.num_lcb * n * d
        if self.residual is not None:
            flops += 2 * self.num_out * n * d
        return flops + 2 * self.num_out * d  # residual add, rounded LayerNorm cost left out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        parts = []
        if self.num_fm:
            xty = torch.einsum("bnd,nk->bdk", x, self.fm_y)  # [B, D, k]
            fm = torch.bmm(x, xty).reshape(batch, -1)  # [B, n*k]
            parts.append(self.fm_mlp(self.fm_norm(fm)).view(batch, self.num_fm, self.dim))
        if self.num_lcb:
            parts.append(torch.einsum("ln,bnd->bld", self.lcb, x))
        out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        skip = x if self.residual is None else torch.einsum("on,bnd->bod", self.residual, x)
        return self.norm(out + skip)


class Wukong(SparseArchModel):
    """Wukong over an embedding collection whose features all have one dim D."""

    def __init__(
        self,
        sparse: PooledEmbeddingCollection,
        num_dense: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        config: WukongConfig | None = None,
        *,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        config = config or WukongConfig()
        dim = shared_embedding_dim(sparse, "Wukong")
        rows = config.dense_rows
        check_dense_input(num_dense, bottom_mlp)
        check_mlp_ends(
            bottom_mlp,
            top_mlp,
            rows * dim,
            f"dense_rows * embedding dim = {rows} * {dim} = {rows * dim}",
        )
        self.config = config
        self.sparse = sparse
        self.embedding_dim = dim
        self.num_sparse = len(sparse.feature_names)
        mlp = partial(MLP, dropout=dropout, batch_norm=batch_norm)
        self.bottom = mlp(num_dense, bottom_mlp) if num_dense else None
        layers, width = [], self.num_sparse + (rows if self.bottom is not None else 0)
        for _ in range(config.num_layers):
            layers.append(
                WukongLayer(
                    width,
                    dim,
                    config.num_fm,
                    config.num_lcb,
                    config.fm_rank,
                    config.fm_mlp,
                    dropout=dropout,
                    batch_norm=batch_norm,
                )
            )
            width = layers[-1].num_out
        self.layers = nn.Sequential(*layers)
        self.top = mlp(width * dim, top_mlp, final_activation=False)

    def num_dense_parameters(self) -> int:
        """Parameters that the dense optimizer owns."""
        return count_dense_parameters(self)

    def flops_per_sample(self) -> int:
        """Forward FLOPs of the dense part per sample."""
        return (
            (self.bottom.flops_per_sample() if self.bottom is not None else 0)
            + sum(layer.flops_per_sample() for layer in cast("Iterable[WukongLayer]", self.layers))
            + self.top.flops_per_sample()
            + self.sparse.flops_per_sample()
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        batch = dense.shape[0]
        x = self.sparse(sparse).stacked()
        if self.bottom is not None:
            x_dense = self.bottom(dense).view(batch, self.config.dense_rows, self.embedding_dim)
            x = torch.cat([x_dense, x], dim=1)
        return self.top(self.layers(x).reshape(batch, -1)).squeeze(1)
