"""Memory tiers of embedding tables (``modules/cached.py``): all rows in device memory,
or a cache of a share of them in front of a backing store in host memory, on SSD or
in a key-value store.

One table's settings are a ``TierConfig``; a collection's, a ``TableTiers`` (the
collection-wide tier and the tables that set their own), which the run config
resolves once from ``[embedding]`` and ``[embedding.tables.<t>]``
(``EmbeddingConfig.tiers``). With the tables' sizes known, ``TableTiers.place``
decides each table's ``TablePlacement`` (the one place that decides whether a table
runs cached, and with how many slots)::

    EmbeddingConfig.tiers() ─► TableTiers ─► place(table) ─► TablePlacement
                                                              cache_rows > 0: cached
                                                              0: device memory
    build_embedding_collection: a CachedEmbeddingBagCollection of the placements when
    some table runs cached; a sharded run's unmaterialized collection carries them
    (``EmbeddingBagCollection.tiers``) and each rank caches its shards of those tables.

Settings, as the run config writes them::

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

import logging
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from towerrec.memory import available_memory_bytes
from towerrec.modules.tables import TableConfig
from towerrec.modules.tier_store import format_bytes
from towerrec.utils import at_least, parse_enum

__all__ = [
    "Background",
    "Backing",
    "CacheMaps",
    "CachePolicy",
    "Memory",
    "SsdReads",
    "TablePlacement",
    "TableTiers",
    "TierConfig",
    "background_on",
    "mapped_reads_on",
    "parse_background",
]

log = logging.getLogger("towerrec")


class Memory(StrEnum):
    DEVICE = "device"  # every row in the kernel's memory (the default)
    CACHED = "cached"  # a cache of cache_fraction of the rows over a backing store


class CachePolicy(StrEnum):
    LRU = "lru"  # evict the row used longest ago
    LFU = "lfu"  # evict the row used least often since it was fetched (ties: LRU)


class CacheMaps(StrEnum):
    """Where a cache's id -> slot maps, usage counts and victim choice live and run."""

    AUTO = "auto"  # device when the slot tables are on an accelerator, else host
    HOST = "host"  # host memory: a lookup copies its batch's ids to the host
    DEVICE = "device"  # beside the slot tables: only missed and evicted rows cross

    def on_device(self, device_type: str) -> bool:
        """Whether the bookkeeping runs beside slot tables on a ``device_type`` device."""
        return self is CacheMaps.DEVICE or (self is CacheMaps.AUTO and device_type != "cpu")


class Backing(StrEnum):
    HOST = "host"  # a full-size array in host memory
    SSD = "ssd"  # a file of fixed-size rows under backing_path, memory-mapped
    KV = "kv"  # an LMDB store under backing_path keyed by row id; rows made on first touch


class Background(StrEnum):
    """Whether a cache's background thread runs (the read ahead, the write-behind)."""

    AUTO = "auto"  # on when this process has cores beyond its torch threads (``background_on``)
    ON = "on"
    OFF = "off"


class SsdReads(StrEnum):
    """How an SSD store reads a batch's missed rows and writes back its evicted ones
    (``SsdStore``)."""

    AUTO = "auto"  # mapped when the stores' files fit in memory (``mapped_reads_on``), else io
    MAPPED = "mapped"  # a gather from / scatter into the file's mapping: no system call a row
    IO = "io"  # pread / io_uring (``row_io.py``): many reads in flight for a disk


def parse_background(value: bool | str | Background, key: str) -> Background:
    """A background setting as the config gives it: ``true`` / ``false`` or a
    ``Background`` name."""
    if isinstance(value, bool):
        return Background.ON if value else Background.OFF
    return parse_enum(Background, value, key)


def background_on(
    setting: bool | Background,
    what: str,
    *,
    device: torch.device | str = "cpu",
    cpus: int | None = None,
    torch_threads: int | None = None,
) -> bool:
    """Whether the background thread ``what`` runs: ``on`` / ``off`` as set; ``auto``, decided
    now and logged: on where the step computes on an accelerator (``device``: its torch
    threads leave the host's cores free), else when the cores this process may run on
    (``cpus``: ``os.sched_getaffinity``) exceed its torch threads (``torch_threads``:
    ``torch.get_num_threads``). A background thread on cores the step's torch threads fill
    takes its time from the step: with the rows in the page cache, 2 cores and 2 torch
    threads, the read ahead and write-behind made an SSD-backed step slower, not faster
    (docs/benchmarks.md)."""
    choice = parse_background(setting, what)
    if choice is not Background.AUTO:
        return choice is Background.ON
    kind = torch.device(device).type
    if kind != "cpu":
        log.info("%s = auto: on (the step computes on %s)", what, kind)
        return True
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    torch_threads = torch.get_num_threads() if torch_threads is None else torch_threads
    on = cpus > torch_threads
    log.info(
        "%s = auto: %s (%d cores for this process, %d torch threads%s)",
        what,
        "on" if on else "off",
        cpus,
        torch_threads,
        "" if on else "; no spare core for a background thread",
    )
    return on


def mapped_reads_on(
    file_bytes: int, available_bytes: int | None = None, processes: int | None = None
) -> bool:
    """``embedding.ssd_reads = auto``, decided now and logged: whether SSD stores of
    ``file_bytes`` in all read their missed rows through the files' mapping. Mapped when
    the files of the ``processes`` on this machine (``LOCAL_WORLD_SIZE``, each taken to
    hold as many) take at most half of the memory available now (``available_bytes``:
    ``MemAvailable``), so that the page cache keeps them and a read is a gather from memory
    (0.4 us a row against 2.3 for a ``pread`` of a page-cache row, ``bench row-io``); else
    ``io``, whose reads keep many requests in flight for the disk where a mapping's page
    fault reads one page at a time. Mapped pages count in the process's resident set as
    file pages (``RssFile``): page cache that the kernel reclaims, the same pages an ``io``
    read copies from."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if processes is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on = available is not None and 2 * file_bytes * processes <= available
    log.info(
        "embedding.ssd_reads = auto: %s (store files %s%s, memory available %s%s)",
        "mapped" if on else "io",
        format_bytes(file_bytes),
        f" a process, {processes} processes here" if processes > 1 else "",
        "unknown" if available is None else format_bytes(available),
        "" if on else "; files above half of it read from the disk, many reads in flight",
    )
    return on


@dataclass(frozen=True)
class TierConfig:
    """Where one table's rows live (module doc); validated on construction. The fields
    are the run config's ``[embedding]`` keys of the same names."""

    memory: Memory = Memory.DEVICE
    cache_fraction: float = 0.05  # cached: share of a table's rows in the fast tier
    cache_policy: CachePolicy = CachePolicy.LRU  # cached: lru | lfu
    # cached: host (array in host memory) | ssd (row file) | kv (LMDB keyed by 64-bit id)
    backing: Backing = Backing.HOST
    backing_path: str = ""  # ssd, kv: directory of the tables' stores
    cache_min_rows: int = 0  # cached: only tables with more rows are cached
    cache_slots: int = 0  # cached: the cache's rows (0: cache_fraction); kv needs it
    cache_maps: CacheMaps = CacheMaps.AUTO  # cached: where the id -> slot maps live
    # cached over ssd: evicted rows land in a thread of the store's: auto | on | off (or a bool)
    write_behind: Background | bool = Background.AUTO
    # cached over ssd: missed rows read through the files' mapping or by io: auto | mapped | io
    ssd_reads: SsdReads = SsdReads.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "write_behind", parse_background(self.write_behind, "embedding.write_behind")
        )
        object.__setattr__(
            self, "ssd_reads", parse_enum(SsdReads, self.ssd_reads, "embedding.ssd_reads")
        )
        object.__setattr__(self, "memory", parse_enum(Memory, self.memory, "embedding.memory"))
        object.__setattr__(
            self, "cache_maps", parse_enum(CacheMaps, self.cache_maps, "embedding.cache_maps")
        )
        object.__setattr__(
            self,
            "cache_policy",
            parse_enum(CachePolicy, self.cache_policy, "embedding.cache_policy"),
        )
        object.__setattr__(self, "backing", parse_enum(Backing, self.backing, "embedding.backing"))
        at_least("embedding.cache_min_rows", self.cache_min_rows, 0)
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
    def asks_for_cache(self) -> bool:
        """``memory = "cached"``: whether a table of this tier runs cached is
        ``TableTiers.place``'s decision (its size)."""
        return self.memory is Memory.CACHED


@dataclass(frozen=True)
class TablePlacement:
    """Where one table's rows live, decided for its size (``TableTiers.place``): a cache
    of ``cache_rows`` slots over the backing store ``tier`` names, or (``cache_rows``
    0) every row in device memory."""

    tier: TierConfig
    cache_rows: int = 0

    @property
    def is_cached(self) -> bool:
        return self.cache_rows > 0

    @property
    def is_kv(self) -> bool:
        """Cached over a kv store: rows keyed by 64-bit id, created on first touch."""
        return self.is_cached and self.tier.backing is Backing.KV


@dataclass(frozen=True)
class TableTiers:
    """The memory tier of every table of a collection: ``tables`` holds the tiers of the
    tables that set their own, every other table takes ``default``."""

    default: TierConfig = field(default_factory=TierConfig)
    tables: Mapping[str, TierConfig] = field(default_factory=dict)

    def of(self, table: str) -> TierConfig:
        """The tier settings of the table named ``table``."""
        return self.tables.get(table, self.default)

    def place(self, table: str, num_embeddings: int, *, warn: bool = True) -> TablePlacement:
        """Whether table ``table`` of ``num_embeddings`` rows runs cached, and its cache's
        slots: when its tier asks for a cache and it has more than ``cache_min_rows``
        rows, ``cache_slots`` or ``cache_fraction`` of its rows (at least one); a cache
        that would hold every row leaves the table in device memory, with a warning
        (``warn``)."""
        tier = self.of(table)
        if not (tier.asks_for_cache and num_embeddings > tier.cache_min_rows):
            return TablePlacement(tier)
        rows = tier.cache_slots or max(1, math.ceil(tier.cache_fraction * num_embeddings))
        if rows < num_embeddings:
            return TablePlacement(tier, rows)
        if warn:
            warnings.warn(
                f"table {table!r}: a cache of {tier.cache_fraction:g} of its "
                f"{num_embeddings} rows holds the whole table; it is kept in device "
                "memory (memory = 'device')",
                stacklevel=4,
            )
        return TablePlacement(tier)

    def place_tables(self, tables: Sequence[TableConfig]) -> dict[str, TablePlacement]:
        """``{table: placement}`` of every table of ``tables`` (``place``)."""
        return {t.name: self.place(t.name, t.num_embeddings) for t in tables}

    def warn_if_nothing_cached(self, tables: Sequence[TableConfig]) -> None:
        """Cached tables asked for and none large enough (``cache_min_rows``): say so,
        with the threshold and the largest table, rather than train all in memory
        unannounced."""
        asked = [t for t in tables if self.of(t.name).asks_for_cache]
        if not asked:
            return
        largest = max(asked, key=lambda t: t.num_embeddings)
        threshold = self.of(largest.name).cache_min_rows
        if largest.num_embeddings > threshold:
            return  # its cache would hold it whole: ``place`` warned
        warnings.warn(
            f"embedding.memory = 'cached' caches tables of more than embedding.cache_min_rows "
            f"= {threshold:,} rows, and the largest, {largest.name!r}, has "
            f"{largest.num_embeddings:,}: every table stays in memory; lower "
            "embedding.cache_min_rows to cache them",
            stacklevel=3,
        )
