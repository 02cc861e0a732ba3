"""The cache of one table (``modules/cached.py``): its id -> slot map, the eviction
policy's usage counts, dirty bits, write-back to and reads from the backing store, and
rows read ahead for a later lookup.

A row's record (weight, then each per-row optimizer state, ``tier_store.RowLayout``)
moves between store and slot as an exact float32 copy. Victims are slots the current
lookup does not use: empty ones first, then the least recently used (``lru``) or the
least often used since fetched (``lfu``, ties by recency). A prefetched row that was
written back after its read began is read again (its copy would be stale).

LRU victims come from a recency queue (``RecencyQueue``) in time order, so a lookup's
eviction costs in proportion to its batch, not to the cache's size; LFU's counts are
ranked with a top-k over the slots. Slots empty only all at once (``invalidate``), so
the empty ones are the slots ``[filled, cache_rows)``.

The id -> slot map is a dense array of one int32 a row (``DenseSlotMap``) for tables of
dense id ranges, and sorted keys searched with ``searchsorted`` (``SortedSlotMap``,
memory a function of the cache's size) for kv tables, whose ids span up to 2**63.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from towerrec.modules.tables import TableConfig
from towerrec.modules.tier_store import BackingStore
from towerrec.modules.tiers import CachePolicy

__all__ = ["CacheStats", "DenseSlotMap", "RecencyQueue", "SortedSlotMap", "TableCache"]

_PROTECTED = torch.iinfo(torch.int64).max


class CacheStats:
    """Lookups of unique rows (a lookup's distinct ids), how many of them were in the
    cache, and the traffic to the backing store: rows read (a prefetch's when it
    starts, so a prefetched row that a write-back made stale counts again when reread)
    and rows written back, with their bytes (``record_bytes`` a row)."""

    FIELDS = (
        "lookups",
        "hits",
        "train_lookups",
        "train_hits",
        "rows_read",
        "written_back",
        "prefetched",
        "bytes_read",
        "bytes_written",
    )

    def __init__(self, record_bytes: int = 0) -> None:
        self.record_bytes = record_bytes
        self.lookups = 0
        self.hits = 0
        self.train_lookups = 0  # those of training lookups (the rest evaluate)
        self.train_hits = 0
        self.rows_read = 0  # rows read from the store, prefetched or in the lookup
        self.written_back = 0
        self.prefetched = 0  # missing rows that came from a prefetch
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def read(self, rows: int) -> None:
        self.rows_read += rows
        self.bytes_read += rows * self.record_bytes

    def written(self, rows: int) -> None:
        self.written_back += rows
        self.bytes_written += rows * self.record_bytes

    def counts(self) -> list[int]:
        """The counters, in ``FIELDS`` order."""
        return [getattr(self, f) for f in self.FIELDS]

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> CacheStats:
        """Stats holding ``counts`` (``counts()``'s order, e.g. summed over ranks)."""
        if len(counts) != len(cls.FIELDS):
            raise ValueError(f"cache counts need {len(cls.FIELDS)} values, got {len(counts)}")
        out = cls()
        for name, value in zip(cls.FIELDS, counts, strict=True):
            setattr(out, name, int(value))
        return out

    def as_dict(self) -> dict[str, float | int]:
        """One table's record in a run's summary."""
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hit_rate, 6),
            "train_lookups": self.train_lookups,
            "train_hits": self.train_hits,
            "train_hit_rate": round(self.train_hits / max(self.train_lookups, 1), 6),
            "rows_read": self.rows_read,
            "rows_written_back": self.written_back,
            "rows_prefetched": self.prefetched,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }


class DenseSlotMap:
    """id -> slot of a table of ``rows`` dense ids: an int32 array, -1 where not cached."""

    def __init__(self, rows: int) -> None:
        self._slot = torch.full((rows,), -1, dtype=torch.int32)

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots (int64) of ``ids``, -1 for ids not cached."""
        return self._slot[ids].long()

    def set(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self._slot[ids] = slots.to(torch.int32)

    def remove(self, ids: torch.Tensor) -> None:
        self._slot[ids] = -1

    def clear(self) -> None:
        self._slot.fill_(-1)


class SortedSlotMap:
    """id -> slot for sparse 64-bit ids: the cached ids sorted, with their slots; a
    lookup is a ``searchsorted``, an update a merge (memory: two int64 a cached row)."""

    def __init__(self) -> None:
        self._keys = torch.empty(0, dtype=torch.int64)
        self._slots = torch.empty(0, dtype=torch.int64)

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._keys.numel():
            return torch.full(ids.shape, -1, dtype=torch.int64)
        at = torch.searchsorted(self._keys, ids).clamp_(max=self._keys.numel() - 1)
        found = self._keys[at] == ids
        return torch.where(found, self._slots[at], -1)

    def set(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        keys = torch.cat([self._keys, ids])
        order = torch.argsort(keys)
        self._keys = keys[order]
        self._slots = torch.cat([self._slots, slots.long()])[order]

    def remove(self, ids: torch.Tensor) -> None:
        keep = ~torch.isin(self._keys, ids)
        self._keys, self._slots = self._keys[keep], self._slots[keep]

    def clear(self) -> None:
        self._keys = torch.empty(0, dtype=torch.int64)
        self._slots = torch.empty(0, dtype=torch.int64)


class RecencyQueue:
    """Slots in the order of their uses: each use appends ``(slot, stamp)``; an entry whose
    stamp is no longer its slot's last use is stale and skipped. ``oldest`` takes the
    least recently used slots from the front in order, so a cache's LRU victims cost in
    proportion to the slots taken and skipped, not to the cache's size. The buffer is
    compacted (stale entries dropped) when it fills."""

    def __init__(self, capacity: int) -> None:
        self._slots = torch.empty(max(capacity, 1024), dtype=torch.int64)
        self._stamps = torch.empty_like(self._slots)
        self._head = self._tail = 0

    def clear(self) -> None:
        self._head = self._tail = 0

    def push(self, slots: torch.Tensor, stamps: torch.Tensor, last_used: torch.Tensor) -> None:
        """Append uses of ``slots`` at ``stamps`` (ascending, after every stamp queued)."""
        n = slots.numel()
        if self._tail + n > self._slots.numel():
            self._compact(last_used, n)
        self._slots[self._tail : self._tail + n] = slots
        self._stamps[self._tail : self._tail + n] = stamps
        self._tail += n

    def oldest(self, count: int, last_used: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        """The ``count`` least recently used slots that ``protected`` (a mask over the
        slots) leaves out, oldest first; they and the entries passed leave the queue."""
        taken: list[torch.Tensor] = []
        need = count
        while need > 0:
            if self._head >= self._tail:
                raise AssertionError("recency queue ran out of slots")  # callers check room
            end = min(self._tail, self._head + max(2 * need, 1024))
            slots = self._slots[self._head : end]
            usable = (last_used[slots] == self._stamps[self._head : end]) & ~protected[slots]
            at = torch.nonzero(usable).flatten()[:need]
            taken.append(slots[at])
            need -= at.numel()
            self._head = self._head + int(at[-1]) + 1 if need == 0 else end
        return torch.cat(taken)

    def _compact(self, last_used: torch.Tensor, room: int) -> None:
        slots = self._slots[self._head : self._tail]
        stamps = self._stamps[self._head : self._tail]
        live = last_used[slots] == stamps
        slots, stamps = slots[live], stamps[live]
        kept = slots.numel()
        if kept + room > self._slots.numel():
            size = 2 * (kept + room)
            self._slots = torch.empty(size, dtype=torch.int64)
            self._stamps = torch.empty_like(self._slots)
        self._slots[:kept] = slots
        self._stamps[:kept] = stamps
        self._head, self._tail = 0, kept


class TableCache:
    """The id -> slot map of one cached table, its usage for the policy and dirty bits.

    ``weight`` and ``states`` give the slot table's current views inside the kernel
    (``[C, D]``, ``{name: [C] or [C, w]}``; asked for each time: a device move
    rebuilds the kernels).
    """

    def __init__(
        self,
        table: TableConfig,
        cache_rows: int,
        policy: CachePolicy,
        store: BackingStore,
        weight: Callable[[], torch.Tensor],
        states: Callable[[], dict[str, torch.Tensor]],
        sparse_ids: bool = False,
    ) -> None:
        self.table = table
        self.cache_rows = cache_rows
        self.policy = policy
        self.store = store
        self._weight, self._states = weight, states
        self.slot_of: DenseSlotMap | SortedSlotMap = (
            SortedSlotMap() if sparse_ids else DenseSlotMap(table.num_embeddings)
        )
        self.id_of = torch.full((cache_rows,), -1, dtype=torch.int64)
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool)
        self.last_used = torch.zeros(cache_rows, dtype=torch.int64)
        self.uses = torch.zeros(cache_rows, dtype=torch.int64)
        self.recency = RecencyQueue(2 * cache_rows if policy is CachePolicy.LRU else 0)
        self.filled = 0  # slots [0, filled) hold rows; the others are empty
        self._protected = torch.zeros(cache_rows, dtype=torch.bool)
        self.clock = 0
        self.stats = CacheStats(store.layout.record_width * 4)
        self._pending: dict[int, _Prefetch] = {}

    # --------------------------------------------------------------- prefetch
    def prefetch(self, key: int, ids: torch.Tensor, executor: ThreadPoolExecutor) -> None:
        """Start reading the rows of ``ids`` that are not cached now, in the background;
        the lookup that passes ``key`` to ``slots`` takes them."""
        unique = torch.unique(ids)
        missing = unique[self.slot_of.get(unique) < 0]
        self.stats.read(missing.numel())
        self._pending[key] = _Prefetch(missing, executor.submit(self.store.read, missing))

    def _take_prefetched(
        self, key: int | None, missing: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(mask over missing, their records)`` of the rows prefetched under ``key`` that
        no write-back touched since (a written row's prefetched copy is stale)."""
        pending = self._pending.pop(key, None) if key is not None else None
        if pending is None:
            return None
        records = pending.records.result()
        usable = pending.ids
        if pending.written:
            usable = usable[~torch.isin(usable, torch.cat(pending.written))]
        found = torch.isin(missing, usable)
        if not bool(found.any()):
            return None
        at = torch.searchsorted(pending.ids, missing[found])  # both sorted (unique)
        return found, records.index_select(0, at)

    def _written(self, ids: torch.Tensor) -> None:
        for pending in self._pending.values():
            pending.written.append(ids)

    # ----------------------------------------------------------------- lookup
    @torch.no_grad()
    def slots(self, ids: torch.Tensor, training: bool, key: int | None = None) -> torch.Tensor:
        """The slots of ``ids`` (any shape, CPU int64), fetching the rows that miss (those
        prefetched under ``key`` from the prefetch)."""
        unique, inverse = torch.unique(ids, return_inverse=True)
        if unique.numel() > self.cache_rows:
            need = unique.numel() / self.table.num_embeddings
            raise ValueError(
                f"a batch touches {unique.numel()} distinct rows of table {self.table.name!r}, "
                f"more than its cache of {self.cache_rows} slots holds; set "
                f"embedding.cache_slots (or [embedding.tables.{self.table.name}] "
                f"cache_slots) to at least {unique.numel()}, or, with cache_slots = 0, "
                f"cache_fraction to at least {need:.4g}; or use smaller batches"
            )
        slot = self.slot_of.get(unique)
        miss = slot < 0
        missing = unique[miss]
        if missing.numel():
            victims = self._victims(missing.numel(), slot[~miss])
            self._evict(victims)
            records = self._read(missing, key)
            self._fill(victims, missing, records)
            slot[miss] = victims
        elif key is not None:
            self._pending.pop(key, None)
        self.clock += 1
        # Recency: the lookup's clock, then its rows in id order (no ties: ``_victims``
        # picks the same rows as an LRU list updated in that order).
        stamps = (self.clock << 32) + torch.arange(slot.numel())
        self.last_used[slot] = stamps
        if self.policy is CachePolicy.LRU:
            self.recency.push(slot, stamps, self.last_used)
        self.uses[slot] += 1
        if training:
            self.dirty[slot] = True
        self.stats.lookups += unique.numel()
        self.stats.hits += unique.numel() - missing.numel()
        if training:
            self.stats.train_lookups += unique.numel()
            self.stats.train_hits += unique.numel() - missing.numel()
        return slot[inverse]

    def _victims(self, count: int, keep: torch.Tensor) -> torch.Tensor:
        """``count`` slots to reuse: empty ones first, then by the policy, never ``keep``."""
        empty = min(count, self.cache_rows - self.filled)
        out = torch.arange(self.filled, self.filled + empty)  # ``_fill`` moves ``filled``
        if empty == count:
            return out
        if self.policy is CachePolicy.LRU:
            self._protected[keep] = True
            try:
                used = self.recency.oldest(count - empty, self.last_used, self._protected)
            finally:
                self._protected[keep] = False
        else:
            key = (self.uses << 32) + (self.last_used >> 32)
            key[keep] = _PROTECTED
            key[out] = _PROTECTED  # the empty slots just taken
            used = torch.topk(key, count - empty, largest=False, sorted=False).indices
        return torch.cat([out, used])

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Records ``[n, W]`` (store layout) of the rows in ``slots``."""
        weight, states = self._weight(), self._states()
        device = weight.device
        at = slots.to(device)
        parts = [weight.index_select(0, at)]
        for name, _ in self.store.layout.states:
            state = states[name].index_select(0, at)
            parts.append(state.unsqueeze(1) if state.dim() == 1 else state)
        return torch.cat(parts, dim=1).cpu()

    def _read(self, missing: torch.Tensor, key: int | None) -> torch.Tensor:
        """Records of the ``missing`` rows: prefetched ones, the others read now."""
        prefetched = self._take_prefetched(key, missing)
        if prefetched is None:
            self.stats.read(missing.numel())
            return self.store.read(missing)
        found, records = prefetched
        self.stats.prefetched += int(found.sum())
        out = torch.empty(missing.numel(), self.store.layout.record_width)
        out[found] = records
        if not bool(found.all()):
            self.stats.read(int((~found).sum()))
            out[~found] = self.store.read(missing[~found])
        return out

    def _evict(self, slots: torch.Tensor) -> None:
        ids = self.id_of[slots]
        write = (ids >= 0) & self.dirty[slots]
        if bool(write.any()):
            self._written(ids[write])
            self.store.write(ids[write], self._gather(slots[write]))
            self.stats.written(int(write.sum()))
        occupied = ids >= 0
        self.slot_of.remove(ids[occupied])

    def _fill(self, slots: torch.Tensor, ids: torch.Tensor, records: torch.Tensor) -> None:
        weight, states = self._weight(), self._states()
        at = slots.to(weight.device)
        records = records.to(weight.device)
        dim = self.store.layout.embedding_dim
        weight.index_copy_(0, at, records[:, :dim])
        for name, (col, width) in self.store.layout.state_columns().items():
            value = records[:, col] if width == 1 else records[:, col : col + width]
            states[name].index_copy_(0, at, value)
        self.slot_of.set(ids, slots)
        self.id_of[slots] = ids
        self.filled = max(self.filled, int(slots.max()) + 1)  # empty slots are taken in order
        self.dirty[slots] = False
        self.uses[slots] = 0

    # ------------------------------------------------------------ write-back
    @torch.no_grad()
    def flush(self) -> None:
        """Write every dirty row back to the store (rows stay cached, now clean)."""
        slots = torch.nonzero(self.dirty & (self.id_of >= 0)).flatten()
        if slots.numel():
            self._written(self.id_of[slots])
            self.store.write(self.id_of[slots], self._gather(slots))
            self.stats.written(slots.numel())
        self.dirty.zero_()
        self.store.flush()

    def invalidate(self) -> None:
        """Forget every cached row without writing it back (the store was rewritten)."""
        for pending in self._pending.values():
            pending.records.result()  # no read left running over the rewritten store
        self._pending.clear()
        self.slot_of.clear()
        self.id_of.fill_(-1)
        self.dirty.zero_()
        self.last_used.zero_()
        self.uses.zero_()
        self.recency.clear()
        self.filled = 0


@dataclass
class _Prefetch:
    """Rows read ahead for one lookup: sorted ``ids``, their records to come, and the
    ids written back since the read began."""

    ids: torch.Tensor
    records: Future[torch.Tensor]
    written: list[torch.Tensor] = field(default_factory=list)
