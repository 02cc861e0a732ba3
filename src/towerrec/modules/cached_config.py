"""Settings of a table's memory tier (``modules/cached.py``): all rows in device memory,
or a cache of a share of them in front of a backing store in host memory or on SSD.

``TierConfig`` holds one table's settings; the run config's ``embedding`` section gives
the collection-wide ones and ``[embedding.tables.<name>]`` overrides them per table
(``TableStorageConfig.tiers``)::

    memory = "cached", cache_fraction = 0.05, cache_policy = "lru",
    backing = "ssd", backing_path = "/mnt/nvme/tables"
        5% of the table's rows in the kernel's slot table, all rows in
        /mnt/nvme/tables/<table>.tstore

    memory = "cached", cache_slots = 1_000_000, backing = "kv", backing_path = "/mnt/nvme/kv"
        a table of sparse 64-bit ids (num_embeddings may be 2**40): a million rows in
        the slot table, the rows ever trained in an LMDB store
        /mnt/nvme/kv/<table>.kvstore, each created from its id on first touch
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from towerrec.utils import at_least, parse_enum

__all__ = ["Backing", "CachePolicy", "Memory", "TierConfig"]


class Memory(StrEnum):
    DEVICE = "device"  # every row in the kernel's memory (the default)
    CACHED = "cached"  # a cache of cache_fraction of the rows over a backing store


class CachePolicy(StrEnum):
    LRU = "lru"  # evict the row used longest ago
    LFU = "lfu"  # evict the row used least often since it was fetched (ties: LRU)


class Backing(StrEnum):
    HOST = "host"  # a full-size array in host memory
    SSD = "ssd"  # a file of fixed-size rows under backing_path, memory-mapped
    KV = "kv"  # an LMDB store under backing_path keyed by row id; rows made on first touch


@dataclass(frozen=True)
class TierConfig:
    """Where one table's rows live (module doc); validated on construction."""

    memory: Memory = Memory.DEVICE
    cache_fraction: float = 0.05
    cache_policy: CachePolicy = CachePolicy.LRU
    backing: Backing = Backing.HOST
    backing_path: str = ""
    min_rows: int = 0  # only tables with more rows are cached; smaller ones stay on device
    cache_slots: int = 0  # the cache's rows; 0: ceil(cache_fraction * rows)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory", parse_enum(Memory, self.memory, "embedding.memory"))
        object.__setattr__(
            self,
            "cache_policy",
            parse_enum(CachePolicy, self.cache_policy, "embedding.cache_policy"),
        )
        object.__setattr__(self, "backing", parse_enum(Backing, self.backing, "embedding.backing"))
        at_least("embedding.cache_min_rows", self.min_rows, 0)
        if not (math.isfinite(self.cache_fraction) and self.cache_fraction > 0):
            raise ValueError(
                f"embedding.cache_fraction must be > 0 (the share of a table's rows kept in "
                f"the fast tier, e.g. 0.05), got {self.cache_fraction}"
            )
        at_least("embedding.cache_slots", self.cache_slots, 0, hint="0: use cache_fraction")
        remote = self.memory is Memory.CACHED and self.backing is not Backing.HOST
        if remote and not self.backing_path:
            raise ValueError(
                f"embedding.backing = '{self.backing.value}' needs embedding.backing_path, "
                "a writable directory for the tables' stores (e.g. --set "
                "embedding.backing_path=/mnt/nvme/towerrec)"
            )
        if self.memory is Memory.CACHED and self.backing is Backing.KV and not self.cache_slots:
            raise ValueError(
                "embedding.backing = 'kv' needs embedding.cache_slots (or [embedding.tables."
                "<table>] cache_slots), the number of rows the cache holds (a kv table's "
                "num_embeddings may be 2**40, so a fraction of it is no size for a cache; "
                "e.g. --set embedding.cache_slots=1000000)"
            )

    @property
    def is_cached(self) -> bool:
        return self.memory is Memory.CACHED

    def caches(self, num_embeddings: int) -> bool:
        """Whether a table of ``num_embeddings`` rows runs cached."""
        return self.is_cached and num_embeddings > self.min_rows

    def cache_rows(self, num_embeddings: int) -> int:
        """Slots of the cache of a table of ``num_embeddings`` rows (at least one)."""
        if self.cache_slots:
            return self.cache_slots
        return max(1, math.ceil(self.cache_fraction * num_embeddings))
