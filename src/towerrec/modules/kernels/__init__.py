"""Fused table-batched embedding kernels: one call looks up every table of a group.

A kernel holds the weights and optimizer state of several tables that share a
pooling mode and dim, and looks up F features (``feature_table_map[f]`` is the
table of feature f) for a batch of B samples in one call::

    values [N]  ids, key-major jagged layout (see towerrec.sparse)
    offsets [F*B + 1]
    weights [N] optional per-id weights (sum pooling)
      -> pooled [B, F*D]

The optimizer runs inside backward: gradients never reach ``.grad``; the rows
that were looked up are updated in place. Two backends with the same
arithmetic:

- ``TorchKernel``: one ``embedding_bag`` over the tables' concatenated rows and
  an exact sparse update (sort + segment-sum) in a custom autograd function.
- ``FbgemmKernel``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU or
  CUDA build) with the optimizer fused into its backward kernel.

Adam's bias correction counts the kernel's training lookups (``iteration``,
FBGEMM's ``iter``; lookups without autograd, as in evaluation, do not count); it
is the ``step`` of each of the kernel's tables in the optimizer state.

Tables whose columns are split over ranks (a sharded collection's column
shards) cannot finish a row-wise step (row-wise Adagrad, partial row-wise Adam)
alone: the row statistic is the mean of g^2 over all the table's columns.
``defer_rowwise`` hands such tables' updates to a ``RowwiseSync`` (``distributed/column_sync.py``): the
backward computes their row gradients, the sync combines the statistic across
the shards and then calls back to apply the update. A kernel with deferred
tables runs its backward and updates on the pure-PyTorch path on either
backend (FBGEMM's fused kernel takes the mean over its own columns); its
forward is unchanged.

Files: ``base.py`` (the shared base class and row gradients), ``backend.py`` (which
kernel runs where), ``torch_kernel.py``, ``fbgemm_kernel.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from towerrec.modules.kernels.backend import (
    auto_backend,
    fbgemm_available,
    fbgemm_has_kernel,
    resolve_backend,
)
from towerrec.modules.kernels.base import (
    Backend,
    EmbeddingKernel,
    RowwiseStep,
    RowwiseSync,
    TableSpec,
)
from towerrec.modules.kernels.fbgemm_kernel import FbgemmKernel
from towerrec.modules.kernels.torch_kernel import Storage, TorchKernel
from towerrec.modules.tables import Pooling
from towerrec.optim.sparse import EmbeddingOptimizerConfig

__all__ = [
    "Backend",
    "EmbeddingKernel",
    "FbgemmKernel",
    "RowwiseStep",
    "RowwiseSync",
    "Storage",
    "TableSpec",
    "TorchKernel",
    "auto_backend",
    "build_kernel",
    "fbgemm_available",
    "fbgemm_has_kernel",
    "resolve_backend",
]


def build_kernel(
    backend: Backend,
    tables: Sequence[TableSpec],
    feature_table_map: Sequence[int],
    pooling: Pooling,
    optimizer: EmbeddingOptimizerConfig,
    device: torch.device,
    storage: Storage | None = None,
) -> EmbeddingKernel:
    """The kernel of ``backend`` for ``tables``; ``storage``: the tensors it trains in
    place of zero-filled ones (``TorchKernel``; the torch backend only)."""
    dims = [t.embedding_dim for t in tables]
    kind = resolve_backend(backend, device, optimizer.kind, dims, optimizer.weight_decay)
    if kind is Backend.TORCH:
        return TorchKernel(tables, feature_table_map, pooling, optimizer, device, storage)
    if storage is not None:
        raise ValueError(
            "embedding storage (tables in given tensors, e.g. memory-mapped files) needs "
            "the torch backend; set embedding.backend = 'torch'"
        )
    return FbgemmKernel(tables, feature_table_map, pooling, optimizer, device)
