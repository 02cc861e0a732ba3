"""The bookkeeping structures of a table's cache (``modules/table_cache.py``): the
id -> slot maps and the recency queue of LRU victims.

The maps live where the cache's bookkeeping runs (``CacheMaps``, ``modules/tiers.py``):
in host memory, or beside the slot tables on the accelerator, where a lookup's ids
never leave it::

    DenseSlotMap    dense id ranges   int32 [rows], -1 where not cached   get: a gather
    SortedSlotMap   sparse 64-bit ids the cached ids sorted, their slots   get: searchsorted

``RecencyQueue`` serves the host bookkeeping's LRU victims in time order; on an
accelerator the victims are a top-k over every slot (``lowest_slots``), one parallel
pass instead of a walk with a host decision per chunk.
"""

from __future__ import annotations

from types import ModuleType

import torch

from towerrec.memory import advise_huge_pages

__all__ = ["PROTECTED", "DenseSlotMap", "RecencyQueue", "SortedSlotMap", "lowest_slots"]

PROTECTED = torch.iinfo(torch.int64).max  # a key no victim has


def _host_map(rows: int) -> torch.Tensor:
    """A host map of ``rows`` ids, all -1, on 2 MiB pages where the kernel gives them
    (``advise_huge_pages`` before the fill touches them): a batch's ids land anywhere in
    it, and on 4 KiB pages each one that misses the TLB costs a page-table walk (a
    gather and two scatters of 9,332 scattered ids a step over a 124 MB map: 0.64 ms
    against 1.67, ``tools/slot_map_pages.py`` on the AMX Xeon, docs/benchmarks.md)."""
    out = torch.empty(rows, dtype=torch.int32)
    advise_huge_pages(out.data_ptr(), out.nbytes)
    return out.fill_(-1)


class DenseSlotMap:
    """id -> slot of a table of ``rows`` dense ids: an int32 array, -1 where not cached."""

    def __init__(self, rows: int, device: torch.device | None = None) -> None:
        if device is None or torch.device(device).type == "cpu":
            self._slot = _host_map(rows)
        else:
            self._slot = torch.full((rows,), -1, dtype=torch.int32, device=device)

    @property
    def table(self) -> torch.Tensor:
        """The map itself (a native caller reads and updates it in place)."""
        return self._slot

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots (int64) of ``ids``, -1 for ids not cached."""
        return self._slot[ids].long()

    def set(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self._slot[ids] = slots.to(torch.int32)

    def remove(self, ids: torch.Tensor) -> None:
        self._slot[ids] = -1

    def clear(self) -> None:
        self._slot.fill_(-1)

    def to(self, device: torch.device) -> None:
        if torch.device(device).type == "cpu" and not self._slot.is_cpu:
            self._slot = _host_map(self._slot.numel()).copy_(self._slot)
        else:
            self._slot = self._slot.to(device)


class SortedSlotMap:
    """id -> slot for sparse 64-bit ids: the cached ids sorted, with their slots; a
    lookup is a ``searchsorted``, an update a merge (memory: two int64 a cached row)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._keys = torch.empty(0, dtype=torch.int64, device=device)
        self._slots = torch.empty(0, dtype=torch.int64, device=device)

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._keys.numel():
            return torch.full(ids.shape, -1, dtype=torch.int64, device=ids.device)
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
        self._keys = torch.empty(0, dtype=torch.int64, device=self._keys.device)
        self._slots = torch.empty(0, dtype=torch.int64, device=self._keys.device)

    def to(self, device: torch.device) -> None:
        self._keys, self._slots = self._keys.to(device), self._slots.to(device)


def lowest_slots(key: torch.Tensor, count: int, *excluded: torch.Tensor) -> torch.Tensor:
    """The ``count`` slots of smallest ``key`` (one value a slot), never those in
    ``excluded``: a top-k on the key's device, no host decision."""
    key = key.clone()
    for slots in excluded:
        key[slots] = PROTECTED
    return torch.topk(key, count, largest=False, sorted=False).indices


class RecencyQueue:
    """Slots in the order of their uses: each use appends ``(slot, stamp)``; an entry whose
    stamp is no longer its slot's last use is stale and skipped. ``oldest`` takes the
    least recently used slots from the front in order, so a cache's LRU victims cost in
    proportion to the slots taken and skipped, not to the cache's size. The buffer is
    compacted (stale entries dropped) when it fills. Host memory only."""

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

    def native_victims(
        self,
        lib: ModuleType,
        slot: torch.Tensor,
        count: int,
        filled: int,
        last_used: torch.Tensor,
        protected: torch.Tensor,
    ) -> tuple[torch.Tensor, int]:
        """``count`` slots to reuse, in one call of the native bookkeeping (``_cache.c``):
        the empty slots from ``filled`` first, then ``oldest``'s, never a slot in ``slot``
        (a lookup's slots, -1 where missed; ``protected``, all False, is scratch); and how
        many of them were empty."""
        out = torch.empty(count, dtype=torch.int64)
        self._head, empty = lib.victims(
            slot.numpy(),
            count,
            filled,
            last_used.numpy(),
            protected.numpy(),
            self._slots.numpy(),
            self._stamps.numpy(),
            self._head,
            self._tail,
            out.numpy(),
        )
        return out, empty

    def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The buffers and the place where ``n`` uses appended now go, the tail moved past
        them, for a native caller to write; the place is -1 (nothing reserved) when the
        buffer must be compacted first (``push`` them then)."""
        if self._tail + n > self._slots.numel():
            return self._slots, self._stamps, -1
        at = self._tail
        self._tail += n
        return self._slots, self._stamps, at

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
