"""The cache of one table (``modules/cached.py``): its id -> slot map, the eviction
policy's usage counts, dirty bits, write-back to and reads from the backing store, and
rows read ahead for a later lookup.

A row's record (weight, then each per-row optimizer state, ``tier_store.RowLayout``)
moves between store and slot as an exact float32 copy. Victims are slots the current
lookup does not use: empty ones first, then the least recently used (``lru``) or the
least often used since fetched (``lfu``, ties by recency). Slots empty only all at once
(``invalidate``), so the empty ones are the slots ``[filled, cache_rows)``.

Reading ahead (``prefetch``, started by the caller between two lookups, after the one
before the batch's): a later lookup's distinct ids, which of them are not cached, and
those rows' records read from the store, in a background thread while the step goes on
(a lookup first waits for it: the map it reads changes only in lookups). When no lookup
changed the map since, that lookup takes all of it as is, so each missing row is read
once; otherwise (an evaluation's lookup came between) it finds its misses again and
takes the rows read ahead that no write-back touched since (a written row's copy would
be stale), reading the others then.

The bookkeeping (maps, usage, dirty bits, victim choice; ``cache_maps.py``) runs in one
of two places (``CacheMaps``, ``modules/tiers.py``)::

    host     maps in host memory; a lookup's ids come to the host. LRU victims come
             from a recency queue in time order (a lookup's eviction costs in
             proportion to its batch, not to the cache's size); LFU's counts are
             ranked with a top-k over the slots.
    device   maps beside the slot tables (the GPU's memory): ids, unique, misses,
             victims (a top-k over the slots for both policies) and the slot updates
             are tensor operations there; only the missed ids and rows (store -> slot)
             and the evicted dirty ones (slot -> store) cross the link. A read ahead
             (``prefetch``) finds its misses there, in the caller's thread, then reads
             the store in a background thread and copies its rows up on a side stream
             while the current step computes; on the CPU the same code runs
             synchronously.

Both choose the same victims, so their hits, misses and write-backs are equal (LFU up to
its ties). The id -> slot map is a dense array of one int32 a row (``DenseSlotMap``) for
tables of dense id ranges, and sorted keys searched with ``searchsorted``
(``SortedSlotMap``, memory a function of the cache's size) for kv tables, whose ids span
up to 2**63.

On the host, a table of dense ids does a lookup's bookkeeping in five calls of the
native extension (``_cache.c``, one pass over the ids each: the sorted distinct ids with
their slots and misses, the victims, the dirty rows to write back, the map's update, the
stamps) where it is built, and in some 25 tensor operations otherwise; both paths leave
the same state (tests/test_cache_native.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from towerrec.modules import native
from towerrec.modules.cache_maps import DenseSlotMap, RecencyQueue, SortedSlotMap, lowest_slots
from towerrec.modules.tables import TableConfig
from towerrec.modules.tier_store import BackingStore
from towerrec.modules.tiers import CachePolicy

__all__ = ["CacheStats", "TableCache"]

CPU = torch.device("cpu")
NO_QUEUE = torch.empty(0, dtype=torch.int64)  # the native calls' queue where none is kept


class CacheStats:
    """Lookups of unique rows (a lookup's distinct ids), how many of them were in the
    cache, and the traffic to the backing store: rows read (a read ahead's when a lookup
    waits for it, so a row read ahead that a write-back made stale counts again when
    reread) and rows written back, with their bytes (``record_bytes`` a row)."""

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


class TableCache:
    """The id -> slot map of one cached table, its usage for the policy and dirty bits.

    ``weight`` and ``states`` give the slot table's current views inside the kernel
    (``[C, D]``, ``{name: [C] or [C, w]}``; asked for each time: a device move
    rebuilds the kernels). ``on_device``: the bookkeeping runs on ``device``, beside the
    slot tables (module doc), and lookups pass their ids there; else in host memory,
    with ids on the CPU.
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
        *,
        on_device: bool = False,
        device: torch.device = CPU,
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
        self.on_device, self.device = False, CPU
        self.recency: RecencyQueue | None = None
        self._protected = torch.zeros(0, dtype=torch.bool)
        self.filled = 0  # slots [0, filled) hold rows; the others are empty
        self.clock = 0
        self.stats = CacheStats(store.layout.record_width * 4)
        self._pending: dict[int, _Prefetch] = {}
        self._version = 0  # counts the changes of the id -> slot map
        self._stream: torch.cuda.Stream | None = None
        self.place(on_device, device)

    def place(self, on_device: bool, device: torch.device) -> None:
        """Run the bookkeeping beside slot tables on ``device`` (``on_device``), or in
        host memory; the cached rows stay (the slot tables moved with them). Reads
        ahead in flight are waited for and dropped."""
        self._drop_pending()
        target = torch.device(device) if on_device else CPU
        self.slot_of.to(target)
        for name in ("id_of", "dirty", "last_used", "uses"):
            setattr(self, name, getattr(self, name).to(target))
        self._stream = None
        if on_device or self.policy is not CachePolicy.LRU:
            self.recency, self._protected = None, torch.zeros(0, dtype=torch.bool)
        elif self.recency is None:  # the host's LRU queue, from the slots' last uses
            self.recency = RecencyQueue(2 * self.cache_rows)
            self._protected = torch.zeros(self.cache_rows, dtype=torch.bool)
            order = torch.argsort(self.last_used[: self.filled])
            self.recency.push(order, self.last_used[order], self.last_used)
        self.on_device, self.device = on_device, target
        dense = isinstance(self.slot_of, DenseSlotMap)
        self._native = native.cache if dense and not on_device else None
        if self._native is not None and not self._protected.numel():
            self._protected = torch.zeros(self.cache_rows, dtype=torch.bool)

    # --------------------------------------------------------------- prefetch
    def prefetch(self, key: int, ids: torch.Tensor, executor: ThreadPoolExecutor) -> None:
        """Start reading ahead the rows of ``ids`` that are not cached (module doc); the
        lookup that passes ``key`` to ``slots`` takes them. The caller starts it between
        lookups: host bookkeeping finds the misses in ``executor``'s thread, device
        bookkeeping here (on the device), and reads them there."""
        if not self.on_device:
            future = executor.submit(self._find_and_read, ids)
        else:
            unique, inverse, slot, missing = self._find(ids)
            records = self._read_ahead(missing, executor)
            future = _then(records, lambda r: _Ahead(unique, inverse, slot, missing, r))
        self._pending[key] = _Prefetch(ids, self._version, future)

    def _find(
        self, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(unique ids, each id's place among them, their slots (-1: not cached), the
        missing ids)`` of a lookup of ``ids`` now."""
        if self._native is not None and isinstance(self.slot_of, DenseSlotMap):
            flat = ids.reshape(-1).long().contiguous()
            out = torch.empty(4, flat.numel(), dtype=torch.int64)
            u, m = self._native.find(
                flat.numpy(),
                self.slot_of.table.numpy(),
                out[0].numpy(),
                out[1].numpy(),
                out[2].numpy(),
                out[3].numpy(),
            )
            return out[0, :u], out[1].view(ids.shape), out[2, :u], out[3, :m]
        unique, inverse = torch.unique(ids, return_inverse=True)
        slot = self.slot_of.get(unique)
        return unique, inverse, slot, unique[slot < 0]

    def _find_and_read(self, ids: torch.Tensor) -> _Ahead:
        """What a lookup of ``ids`` would find now, with its missing rows' records (runs in
        the background thread)."""
        unique, inverse, slot, missing = self._find(ids)
        return _Ahead(unique, inverse, slot, missing, self.store.read(missing))

    def _read_ahead(self, ids: torch.Tensor, executor: ThreadPoolExecutor) -> Future[torch.Tensor]:
        """The records of ``ids``, on the bookkeeping's device, to come: on a GPU read in
        ``executor``'s thread and copied up on a side stream there; on the CPU read now."""
        if self.device.type == "cpu":  # the same path, synchronously
            done: Future[torch.Tensor] = Future()
            done.set_result(self.store.read(ids))
            return done
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return executor.submit(_read_to_device, self.store, ids.cpu(), self._stream)

    def _settle(self, key: int | None) -> tuple[_Prefetch, _Ahead] | None:
        """Wait for the reads ahead (the lookup about to run changes the map they read);
        take the one of ``key`` and drop those of earlier keys (their lookups never
        came)."""
        taken = None
        for k in list(self._pending):
            ahead = self._pending[k].future.result()
            if key is not None and k <= key:
                pending = self._pending.pop(k)
                self.stats.read(ahead.missing.numel())
                if k == key:
                    taken = pending, ahead
        if taken is not None and taken[1].records.is_cuda:  # copied on a side stream
            taken[1].records.record_stream(torch.cuda.current_stream(taken[1].records.device))
        return taken

    def _written(self, ids: torch.Tensor) -> None:
        for pending in self._pending.values():
            pending.written.append(ids)

    def _drop_pending(self) -> None:
        for pending in self._pending.values():
            pending.future.result()  # no read left running (over a store rewritten next)
        self._pending.clear()
        self._version += 1

    # ----------------------------------------------------------------- lookup
    @torch.no_grad()
    def slots(self, ids: torch.Tensor, training: bool, key: int | None = None) -> torch.Tensor:
        """The slots of ``ids`` (any shape, int64 on the bookkeeping's device), fetching
        the rows that miss (those read ahead under ``key`` from the read ahead)."""
        taken = self._settle(key)
        ahead = None  # the read ahead, when no lookup changed the map since it started
        if taken is not None and taken[0].version == self._version:
            ahead = taken[1] if torch.equal(taken[0].ids, ids) else None
        if ahead is not None:
            unique, inverse, slot, missing = ahead.unique, ahead.inverse, ahead.slot, ahead.missing
        else:
            unique, inverse, slot, missing = self._find(ids)
        if unique.numel() > self.cache_rows:
            need = unique.numel() / self.table.num_embeddings
            raise ValueError(
                f"a batch touches {unique.numel()} distinct rows of table {self.table.name!r}, "
                f"more than its cache of {self.cache_rows} slots holds; set "
                f"embedding.cache_slots (or [embedding.tables.{self.table.name}] "
                f"cache_slots) to at least {unique.numel()}, or, with cache_slots = 0, "
                f"cache_fraction to at least {need:.4g}; or use smaller batches"
            )
        if missing.numel():
            victims, empty = self._victims(missing.numel(), slot)
            self._evict(victims[empty:])  # the first ``empty`` held no row
            if ahead is not None:
                records = ahead.records
                self.stats.prefetched += missing.numel()
            else:
                records = self._read(missing, taken)
            if ahead is not None or self._native is None:
                slot = slot.clone()  # (a read ahead's finding is not written into)
            self._fill(victims, empty, missing, records, slot)
            self._version += 1
            self.filled += empty  # the empty slots are taken in order
        self.clock += 1
        out = self._touch(slot, inverse, training)
        self.stats.lookups += unique.numel()
        self.stats.hits += unique.numel() - missing.numel()
        if training:
            self.stats.train_lookups += unique.numel()
            self.stats.train_hits += unique.numel() - missing.numel()
        return out

    def _touch(self, slot: torch.Tensor, inverse: torch.Tensor, training: bool) -> torch.Tensor:
        """Record the lookup of the rows in ``slot`` (its distinct ids' slots, in id order)
        at the clock: recency stamps, uses, dirty bits when ``training``; the slot of each
        id (``slot[inverse]``)."""
        # Recency: the lookup's clock, then its rows in id order (no ties: ``_victims``
        # picks the same rows as an LRU list updated in that order).
        if self._native is not None:
            out = torch.empty(inverse.shape, dtype=torch.int64)
            q_slots, q_stamps, at = NO_QUEUE, NO_QUEUE, -1
            if self.recency is not None:
                q_slots, q_stamps, at = self.recency.reserve(slot.numel())
            self._native.touch(
                slot.numpy(),
                inverse.reshape(-1).numpy(),
                out.view(-1).numpy(),
                self.clock,
                training,
                self.last_used.numpy(),
                self.uses.numpy(),
                self.dirty.numpy(),
                q_slots.numpy(),
                q_stamps.numpy(),
                at,
            )
            if self.recency is not None and at < 0:  # the queue is compacted first
                stamps = (self.clock << 32) + torch.arange(slot.numel())
                self.recency.push(slot, stamps, self.last_used)
            return out
        stamps = (self.clock << 32) + torch.arange(slot.numel(), device=slot.device)
        self.last_used[slot] = stamps
        if self.recency is not None:
            self.recency.push(slot, stamps, self.last_used)
        self.uses[slot] += 1
        if training:
            self.dirty[slot] = True
        return slot[inverse]

    def _victims(self, count: int, slot: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``count`` slots to reuse: empty ones first, then by the policy, never one of the
        lookup's ``slot`` (-1 where missed); and how many of them were empty."""
        if self._native is not None and self.recency is not None:
            return self.recency.native_victims(
                self._native, slot, count, self.filled, self.last_used, self._protected
            )
        keep = slot[slot >= 0]
        empty = min(count, self.cache_rows - self.filled)
        out = torch.arange(self.filled, self.filled + empty, device=self.device)
        if empty == count:
            return out, empty
        if self.recency is not None:  # LRU on the host: the queue's front
            self._protected[keep] = True
            try:
                used = self.recency.oldest(count - empty, self.last_used, self._protected)
            finally:
                self._protected[keep] = False
        else:  # LRU on a device, LFU: the smallest keys (the empty slots all taken)
            key = self.last_used
            if self.policy is CachePolicy.LFU:
                key = (self.uses << 32) + (self.last_used >> 32)
            used = lowest_slots(key, count - empty, keep, out)
        return torch.cat([out, used]), empty

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Records ``[n, W]`` (store layout, host memory) of the rows in ``slots``."""
        weight, states = self._weight(), self._states()
        at = slots.to(weight.device)
        parts = [weight.index_select(0, at)]
        for name, _ in self.store.layout.states:
            state = states[name].index_select(0, at)
            parts.append(state.unsqueeze(1) if state.dim() == 1 else state)
        return torch.cat(parts, dim=1).cpu()

    def _read_now(self, ids: torch.Tensor) -> torch.Tensor:
        """Records of ``ids`` read from the store now, on the bookkeeping's device."""
        return self.store.read(ids.cpu()).to(self.device)

    def _read(self, missing: torch.Tensor, taken: tuple[_Prefetch, _Ahead] | None) -> torch.Tensor:
        """Records of the ``missing`` rows (sorted): those read ahead in ``taken`` that no
        write-back touched since, the others read now."""
        if taken is None or not taken[1].missing.numel():
            self.stats.read(missing.numel())
            return self._read_now(missing)
        pending, ahead = taken
        at = torch.searchsorted(ahead.missing, missing).clamp_(max=ahead.missing.numel() - 1)
        found = ahead.missing[at] == missing  # both sorted without repeats
        if pending.written:
            found &= ~torch.isin(missing, torch.cat(pending.written))
        count = int(found.sum())
        self.stats.prefetched += count
        if count == missing.numel():
            return ahead.records.index_select(0, at)
        out = torch.empty(missing.numel(), self.store.layout.record_width, device=self.device)
        out[found] = ahead.records.index_select(0, at[found])
        rest = ~found
        self.stats.read(missing.numel() - count)
        out[rest] = self._read_now(missing[rest])
        return out

    def _evict(self, slots: torch.Tensor) -> None:
        """Empty ``slots`` (each holds a row), writing the dirty ones back (the native
        bookkeeping takes their ids out of the map in ``_fill``)."""
        if self._native is not None:
            found = torch.empty(2, slots.numel(), dtype=torch.int64)
            k = self._native.evicted(
                slots.numpy(),
                self.id_of.numpy(),
                self.dirty.numpy(),
                found[0].numpy(),
                found[1].numpy(),
            )
            if k:
                written = found[0, :k]
                self._written(written)
                self.store.write(written, self._gather(found[1, :k]))
                self.stats.written(k)
            return
        ids = self.id_of[slots]
        write = self.dirty[slots]
        written = ids[write]
        if written.numel():
            self._written(written)
            self.store.write(written.cpu(), self._gather(slots[write]))
            self.stats.written(written.numel())
        self.slot_of.remove(ids)

    def _fill(
        self,
        slots: torch.Tensor,
        empty: int,
        ids: torch.Tensor,
        records: torch.Tensor,
        slot: torch.Tensor,
    ) -> None:
        """The rows ``ids`` (their ``records``) into the victims' ``slots`` (the first
        ``empty`` held no row; the others were emptied by ``_evict``), and the lookup's
        ``slot`` (-1 where missed, in missed ids' order) given them."""
        weight, states = self._weight(), self._states()
        at = slots.to(weight.device)
        records = records.to(weight.device)
        dim = self.store.layout.embedding_dim
        weight.index_copy_(0, at, records[:, :dim])
        for name, (col, width) in self.store.layout.state_columns().items():
            value = records[:, col] if width == 1 else records[:, col : col + width]
            states[name].index_copy_(0, at, value)
        if self._native is not None and isinstance(self.slot_of, DenseSlotMap):
            self._native.fill(
                slots.numpy(),
                empty,
                ids.numpy(),
                slot.numpy(),
                self.slot_of.table.numpy(),
                self.id_of.numpy(),
                self.dirty.numpy(),
                self.uses.numpy(),
            )
            return
        slot[slot < 0] = slots
        self.slot_of.set(ids, slots)
        self.id_of[slots] = ids
        self.dirty[slots] = False
        self.uses[slots] = 0

    # ------------------------------------------------------------ write-back
    @torch.no_grad()
    def flush(self) -> None:
        """Write every dirty row back to the store (rows stay cached, now clean)."""
        slots = torch.nonzero(self.dirty & (self.id_of >= 0)).flatten()
        if slots.numel():
            ids = self.id_of[slots]
            self._written(ids)
            self.store.write(ids.cpu(), self._gather(slots))
            self.stats.written(slots.numel())
        self.dirty.zero_()
        self.store.flush()

    def invalidate(self) -> None:
        """Forget every cached row without writing it back (the store was rewritten)."""
        self._drop_pending()
        self.slot_of.clear()
        self.id_of.fill_(-1)
        self.dirty.zero_()
        self.last_used.zero_()
        self.uses.zero_()
        if self.recency is not None:
            self.recency.clear()
        self.filled = 0


def _read_to_device(
    store: BackingStore, ids: torch.Tensor, stream: torch.cuda.Stream
) -> torch.Tensor:
    """A background read: ``ids``' records from ``store``, copied to ``stream``'s device
    from page-locked memory on ``stream`` (the step's stream runs on meanwhile)."""
    records = store.read(ids).pin_memory()
    with torch.cuda.stream(stream):
        out = records.to(stream.device, non_blocking=True)
    stream.synchronize()  # this thread waits; the copy is complete before it is used
    return out


@dataclass
class _Ahead:
    """A read ahead's findings: the distinct ids (sorted) and each id's place among them,
    their slots then (-1: not cached), the missing ids and their records."""

    unique: torch.Tensor
    inverse: torch.Tensor
    slot: torch.Tensor
    missing: torch.Tensor
    records: torch.Tensor


@dataclass
class _Prefetch:
    """A read ahead for one lookup: the lookup's ``ids``, the map's version when it
    started, its findings to come, and the ids written back since it began."""

    ids: torch.Tensor
    version: int
    future: Future[_Ahead]
    written: list[torch.Tensor] = field(default_factory=list)


def _then(records: Future[torch.Tensor], make: Callable[[torch.Tensor], _Ahead]) -> Future[_Ahead]:
    """A future of ``make(records)``, done when ``records`` is."""
    out: Future[_Ahead] = Future()

    def done(f: Future[torch.Tensor]) -> None:
        try:
            out.set_result(make(f.result()))
        except BaseException as e:
            out.set_exception(e)

    records.add_done_callback(done)
    return out
