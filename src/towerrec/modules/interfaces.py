"""The interfaces where embedding collections meet the layers above them.

::

    models      PooledEmbeddingCollection   forward / forward_start -> PooledHandle,
                                            feature_names, embedding_dims, tables,
                                            flops_per_sample, describe, collisions
    optimizers  FusedEmbeddingCollection    tables whose optimizer runs inside backward:
    checkpoints                             learning rate, optimizer state, parameter count
    pipeline    PrefetchingCollection       prefetch a later batch's input, then say
                                            which prefetched input the next forward takes
    trainer,    CachingCollection           tables cached over backing stores: read rows
    run context,                            ahead or not, cache counts, the kv tables'
    checkpoints                             stores to save and load, caches to empty

Implementations:

=====================================  ======  =====  ==========  ======
collection                             pooled  fused  prefetches  caches
=====================================  ======  =====  ==========  ======
``EmbeddingBagCollection``             yes     yes    no          no
``CompactEmbeddingCollection``         yes     no     no          no
``CachedEmbeddingBagCollection``       yes     yes    yes (rows)  yes
``ShardedEmbeddingBagCollection``      yes     yes    yes (ids)   yes (its shards)
=====================================  ======  =====  ==========  ======

A cached collection prefetches the next batch's missing rows from its backing
store (``modules/cached.py``); a sharded one prefetches the input_dist, and with
cached shards their rows too (``distributed/embedding_bag.py``); both are caching
collections, the sharded one through the collection of its rank's shards (with no
table cached, it has nothing to read ahead, count or save). A compact collection is
not fused itself: it holds one (``inner``), which is found and counted once. The fused interface is an abstract base class rather
than a protocol because it is found at run time, on every module of a model,
every step (``fused_embedding_modules``): a nominal check costs a fraction of
a microsecond, a structural one some 15.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import nn

from towerrec.modules.compact_config import EmbeddingKind
from towerrec.modules.kernels import Backend
from towerrec.modules.kv_store import KvStore
from towerrec.modules.table_cache import CacheStats
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor

__all__ = [
    "CachingCollection",
    "FusedEmbeddingCollection",
    "PooledEmbeddingCollection",
    "PooledHandle",
    "PrefetchingCollection",
    "Ready",
]


class PooledHandle(Protocol):
    """A lookup begun: ``wait()`` gives its ``KeyedTensor`` ``[B, sum(D_f)]``."""

    def wait(self) -> KeyedTensor: ...


class Ready:
    """The handle of a lookup already computed (a collection that does not overlap)."""

    def __init__(self, value: KeyedTensor) -> None:
        self.value = value

    def wait(self) -> KeyedTensor:
        return self.value


@runtime_checkable
class PooledEmbeddingCollection(Protocol):
    """What a model calls: pooled lookups of the features of ``tables``.

    ``forward_start`` begins a lookup and returns its handle: a sharded
    collection returns with its output all-to-all in flight (the model computes
    its bottom layers meanwhile), any other with the result ready (``Ready``),
    so a model has one path for every collection.
    """

    @property
    def feature_names(self) -> list[str]: ...

    @property
    def embedding_dims(self) -> list[int]:
        """The dim of each feature, in ``feature_names`` order."""
        ...

    @property
    def tables(self) -> list[TableConfig]:
        """The logical tables (a compact collection stores them in other, smaller ones)."""
        ...

    @property
    def backend(self) -> Backend: ...

    @property
    def num_embedding_parameters(self) -> int: ...

    def __call__(self, features: KeyedJaggedTensor) -> KeyedTensor: ...

    def forward_start(self, features: KeyedJaggedTensor) -> PooledHandle: ...

    def flops_per_sample(self) -> int:
        """Dense FLOPs of the collection itself per sample (projections, combinations)."""
        ...

    def describe(self) -> list[dict[str, Any]]:
        """Per logical table: kind, storage rows and dims, parameters."""
        ...

    def collisions(self) -> dict[str, int] | None:
        """Ids sharing a hashed row with another id, per hashed table; None for a
        collection that stores every table in full."""
        ...


class FusedEmbeddingCollection(nn.Module, ABC):
    """A module holding embedding tables whose optimizer runs inside backward.

    Its tables are not ``nn.Parameter``s: the dense optimizer never sees them
    (``dense_parameters``); the trainer sets their learning rate and the
    checkpoint saves their optimizer state through this interface. Such a
    collection stores each of its tables in full and does no dense compute,
    which gives the defaults of ``flops_per_sample``, ``describe`` and
    ``collisions`` (the ``PooledEmbeddingCollection`` members they share).
    """

    tables: list[TableConfig]

    @property
    @abstractmethod
    def num_embedding_parameters(self) -> int: ...

    @abstractmethod
    def set_learning_rate(self, lr: float) -> None: ...

    @abstractmethod
    def optimizer_state_dict(self, prefix: str = "") -> dict[str, Any]: ...

    @abstractmethod
    def load_optimizer_state_dict(self, state: dict[str, Any], prefix: str = "") -> None: ...

    def flops_per_sample(self) -> int:
        return 0

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "table": t.name,
                "kind": EmbeddingKind.FULL.value,
                "rows": [t.num_embeddings],
                "dims": [t.embedding_dim],
                "params": t.num_parameters,
            }
            for t in self.tables
        ]

    def collisions(self) -> dict[str, int] | None:
        return None


@runtime_checkable
class PrefetchingCollection(Protocol):
    """A collection that can start a batch's input distribution ahead of its forward.

    ``prefetch(features)`` starts it and returns a key; ``use_prefetched(key)``
    makes the collection's next forward take that prefetched input (the forward
    must be of the same features). Every rank prefetches and uses the same
    sequence of batches.
    """

    def prefetch(self, features: KeyedJaggedTensor) -> int: ...

    def use_prefetched(self, key: int) -> None: ...


@runtime_checkable
class CachingCollection(PrefetchingCollection, Protocol):
    """A collection whose cached tables keep their rows in a cache over a backing store
    (``modules/cached.py``; a sharded collection: the cached shards of its rank).

    ``prefetch`` reads a later batch's missing rows in the background; the trainer
    asks ``read_rows_ahead`` whether to run the pipeline that calls it; the run
    context sums ``cache_stats`` over the ranks; checkpoints save and load the stores
    of the kv tables (``kv_stores``: rows keyed by id, no dense array to save), and a
    load from outside the caches empties them (``invalidate``).
    """

    @property
    def cached_tables(self) -> Collection[str]:
        """The tables that run cached (a sharded collection: on some rank, the same on
        every rank)."""
        ...

    def read_rows_ahead(self, on: bool) -> bool:
        """Have each next batch's missing rows read ahead under the pipeline
        (``train/pipeline.py``) when ``on`` (``embedding.prefetch``); returns whether
        there are cached rows to read (the same answer on every rank)."""
        ...

    def cache_stats(self) -> dict[str, CacheStats]:
        """The counts of each cached table's cache (a sharded collection: this rank's)."""
        ...

    @property
    def kv_stores(self) -> Mapping[str, KvStore]:
        """``{table: store}`` of the kv tables held here (each whole on one rank)."""
        ...

    def save_stores(self, directory: str | Path) -> None:
        """Flush, then copy each kv table's store into ``directory/<table>``."""
        ...

    def load_stores(self, directory: str | Path) -> None:
        """Replace each kv table's store by its copy in ``directory/<table>``."""
        ...

    def invalidate(self) -> None:
        """Empty the caches (their stores were written from outside)."""
        ...
