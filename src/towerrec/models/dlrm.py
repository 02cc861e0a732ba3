"""DLRM (Naumov et al., 2019): bottom MLP, pooled embeddings, dot interaction, top MLP.

::

    dense [B, F_d] ─► bottom MLP ─► x [B, D] ──────────────┬──────────────┐
                                                           │              │
    sparse (KeyedJaggedTensor) ─► EmbeddingBagCollection   │              │
                                  ─► E [B, T, D] ──► stack [B, T+1, D]    │
                                                           │              │
                                       pairwise dots (upper triangle)     │
                                                   [B, (T+1)T/2] ──► concat [B, D + (T+1)T/2]
                                                                          │
                                                         top MLP ─► logit [B]

Data without dense features (``num_dense = 0``) has no bottom MLP: the dots are
those of the T embeddings alone and the top MLP reads them alone. With
``concat_embeddings`` the top MLP reads the pooled embeddings ``[B, T*D]`` too,
between x and the dots.

The lookup starts first (``forward_start``): with a sharded collection its output
all-to-all is in flight while the bottom MLP runs. The top MLP's input gets
its alignment zeros (``MLP.input_padding``) in the same concatenation.

The loss lives outside the model (``binary_cross_entropy_with_logits`` in the
trainer); ``forward`` returns logits.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from towerrec.modules.interaction import DotInteraction
from towerrec.modules.interfaces import PooledEmbeddingCollection
from towerrec.modules.mlp import MLP
from towerrec.sparse import KeyedJaggedTensor

__all__ = ["DLRM"]


class DLRM(SparseArchModel):
    """DLRM over an embedding collection whose features all have one dim D.

    ``sparse`` is any ``PooledEmbeddingCollection`` (``modules/interfaces.py``): the
    ``EmbeddingBagCollection``, a compact one, or the sharded twin after ``parallelize``.
    """

    def __init__(
        self,
        sparse: PooledEmbeddingCollection,
        num_dense: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        *,
        self_interaction: bool = False,
        concat_embeddings: bool = False,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        dim = shared_embedding_dim(sparse, "DLRM")
        check_dense_input(num_dense, bottom_mlp)
        check_mlp_ends(
            bottom_mlp, top_mlp, dim, f"the embedding dim {dim} (it is dotted with the embeddings)"
        )
        self.num_sparse = len(sparse.feature_names)
        self.embedding_dim = dim
        self.sparse = sparse
        self.concat_embeddings = concat_embeddings
        mlp = partial(MLP, dropout=dropout, batch_norm=batch_norm)
        self.bottom = mlp(num_dense, bottom_mlp) if num_dense else None
        num_vectors = self.num_sparse + int(self.bottom is not None)
        self.interaction = DotInteraction(num_vectors, self_interaction)
        top_in = self.interaction.out_features + (dim if self.bottom is not None else 0)
        top_in += self.num_sparse * dim if concat_embeddings else 0
        self.top = mlp(top_in, top_mlp, final_activation=False)

    @property
    def representation_module(self) -> nn.Module:
        """The top MLP: its input ``[B, top_in]`` is the example's representation
        (``RepresentationModel``), read by contrastive losses."""
        return self.top

    def num_dense_parameters(self) -> int:
        """Parameters that the dense optimizer owns."""
        return count_dense_parameters(self)

    def flops_per_sample(self) -> int:
        """Forward FLOPs of the dense part per sample (MLPs and interaction)."""
        return (
            (self.bottom.flops_per_sample() if self.bottom is not None else 0)
            + self.interaction.flops_per_sample(self.embedding_dim)
            + self.top.flops_per_sample()
            + self.sparse.flops_per_sample()
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        in_flight = self.sparse.forward_start(sparse)  # sharded: all-to-all in flight ...
        x = self.bottom(dense) if self.bottom is not None else None  # ... while this runs
        pooled = in_flight.wait()
        if x is not None and not self.concat_embeddings:
            joined = self.interaction.joined(x, pooled.values(), self.top.input_padding)
            if joined is not None:  # one native pass each way (DotInteraction.joined)
                return self.top(joined).squeeze(1)
        embeddings = pooled.stacked()
        stacked = embeddings if x is None else torch.cat([x.unsqueeze(1), embeddings], dim=1)
        interactions = self.interaction(stacked)
        parts = [] if x is None else [x]
        if self.concat_embeddings:
            parts.append(pooled.values())
        parts.append(interactions)
        if self.top.input_padding:  # the top MLP's zero columns, in the same copy
            parts.append(interactions.new_zeros(interactions.shape[0], self.top.input_padding))
        return self.top(torch.cat(parts, dim=1)).squeeze(1)
