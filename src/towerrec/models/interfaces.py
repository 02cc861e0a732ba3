"""The interface of a recommendation model, as the trainer and benchmarks use it.

Implementations: ``DLRM``, ``DCN``, ``Wukong``, ``DMT`` (single device, also
after ``parallelize``, which swaps their collection for its sharded twin) and
``TowerParallelDMT`` (``distributed/towers.py``), each a ``SparseArchModel``.
"""

from __future__ import annotations

from typing import Protocol, cast, runtime_checkable

import torch
from torch import nn

from towerrec.modules.interfaces import PooledEmbeddingCollection
from towerrec.sparse import KeyedJaggedTensor

__all__ = ["RecommendationModel", "RepresentationModel", "SparseArchModel"]


@runtime_checkable
class RecommendationModel(Protocol):
    """``model(dense [B, F_d], sparse) -> logits [B]`` over a pooled-embedding collection."""

    @property
    def sparse(self) -> PooledEmbeddingCollection:
        """The embedding collection the model looks its features up in."""
        ...

    def __call__(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor: ...

    def flops_per_sample(self) -> int:
        """Forward FLOPs per sample of the dense part (and the collection's own)."""
        ...

    def num_dense_parameters(self) -> int:
        """Parameters of the whole model that the dense optimizer owns (on a rank that
        holds only part of the model, the whole model's count)."""
        ...


@runtime_checkable
class RepresentationModel(Protocol):
    """A model with a representation of each example: the input ``[B, R]`` of its
    ``representation_module`` (the DLRM's: its top MLP, which reads the bottom MLP's output,
    the dots and, with ``concat_embeddings``, the pooled embeddings). Contrastive losses
    (``loss.kind = "punce"``) read it with a forward pre-hook on that module."""

    @property
    def representation_module(self) -> nn.Module:
        """The module whose first input is the representation ``[B, R]``."""
        ...


class SparseArchModel(nn.Module):
    """A model whose embedding collection is its submodule ``sparse``, reached through a
    property of the class.

    From Python 3.12 ``isinstance`` against a runtime-checkable protocol looks members
    up with ``inspect.getattr_static``, which does not see an ``nn.Module``'s registered
    submodules: a model holding ``sparse`` as a plain submodule is no
    ``RecommendationModel`` there. The property makes the member part of the class.
    """

    @property
    def sparse(self) -> PooledEmbeddingCollection:
        collection = self._modules.get("sparse")
        if collection is None:
            raise AttributeError(f"{type(self).__name__} has no embedding collection yet")
        return cast(PooledEmbeddingCollection, collection)

    @sparse.setter
    def sparse(self, collection: PooledEmbeddingCollection) -> None:
        # ``nn.Module.__setattr__`` registers a module itself; only other values get here.
        raise TypeError(
            f"{type(self).__name__}.sparse must be an nn.Module embedding collection, got "
            f"{type(collection).__name__}"
        )
