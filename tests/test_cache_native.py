"""The native host bookkeeping of a cached table (``_cache.c``) against its PyTorch path:
the same lookups leave the same state (slots returned, maps, stamps, uses, dirty bits,
the recency queue's victims, the slot tables, the store's rows and the counts), and each
native call against an independent oracle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

from towerrec.modules import native
from towerrec.modules.table_cache import TableCache
from towerrec.modules.tables import TableConfig
from towerrec.modules.tier_store import HostStore, RowLayout
from towerrec.modules.tiers import CachePolicy

lib = native.cache
pytestmark = pytest.mark.skipif(lib is None, reason="the native extension is not built here")

ROWS, DIM = 5000, 4


def _same(value):
    return value


def make_cache(policy: CachePolicy, cache_rows: int, use_native: bool, monkeypatch) -> TableCache:
    layout = RowLayout("t", ROWS, DIM, (("momentum1", 1),))
    store = HostStore(layout)
    store.records.copy_(
        torch.arange(ROWS * layout.record_width, dtype=torch.float32).view(ROWS, -1)
    )
    weight = torch.zeros(cache_rows, DIM)
    states = {"momentum1": torch.zeros(cache_rows)}
    with monkeypatch.context() as m:
        if not use_native:
            m.setattr(native, "cache", None)
        cache = TableCache(
            TableConfig("t", ROWS, DIM),
            cache_rows,
            policy,
            store,
            weight=partial(_same, weight),
            states=partial(_same, states),
        )
    assert (cache._native is not None) == use_native
    return cache


def state(cache: TableCache) -> dict[str, object]:
    return {
        "map": cache.slot_of.table.clone(),
        "id_of": cache.id_of.clone(),
        "dirty": cache.dirty.clone(),
        "last_used": cache.last_used.clone(),
        "uses": cache.uses.clone(),
        "weight": cache._weight().clone(),
        "momentum1": cache._states()["momentum1"].clone(),
        "store": cache.store.records.clone(),
        "filled": cache.filled,
        "clock": cache.clock,
        "stats": cache.stats.counts(),
    }


def assert_same(a: dict[str, object], b: dict[str, object], where: str) -> None:
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{name} differs {where}"
        else:
            assert x == y, f"{name} differs {where}: {x} != {y}"


def zipf(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    weights = torch.arange(1, ROWS + 1, dtype=torch.float64) ** -1.05
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return torch.empty(shape, dtype=torch.int64)
    rank = torch.multinomial(weights, n, replacement=True, generator=gen)
    return ((rank * 7919) % ROWS).view(shape)


@pytest.mark.parametrize("policy", [CachePolicy.LRU, CachePolicy.LFU])
def test_native_bookkeeping_leaves_the_torch_paths_state(monkeypatch, policy):
    """Lookups of many shapes, training and evaluating, with write-backs (the updated
    slot tables), flushes, invalidations and the recency queue's compactions."""
    fast = make_cache(policy, 400, True, monkeypatch)
    slow = make_cache(policy, 400, False, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    for step in range(160):
        shape = [(300,), (12, 25), (1,), (0,), (399,)][step % 5]
        ids = zipf(gen, shape)
        training = step % 7 != 3
        out_fast = fast.slots(ids, training)
        out_slow = slow.slots(ids, training)
        assert out_fast.shape == ids.shape and torch.equal(out_fast, out_slow), step
        assert torch.equal(fast.id_of[out_fast], ids), step  # each id's slot holds it
        if training:  # the step's update of the rows it used
            for cache, out in ((fast, out_fast), (slow, out_slow)):
                cache._weight()[out.reshape(-1)] += 1.0
                cache._states()["momentum1"][out.reshape(-1)] += 0.5
        if step % 37 == 36:
            fast.flush()
            slow.flush()
        if step == 100:
            fast.invalidate()
            slow.invalidate()
        assert_same(state(fast), state(slow), f"after step {step}")
    assert fast.stats.written_back > 0 and fast.stats.misses > 0


def test_native_bookkeeping_with_reads_ahead(monkeypatch):
    """A read ahead finds its misses natively in a background thread; taken as is or
    found again after an evaluation's lookup came between, as on the torch path."""
    fast = make_cache(CachePolicy.LRU, 300, True, monkeypatch)
    slow = make_cache(CachePolicy.LRU, 300, False, monkeypatch)
    gen = torch.Generator().manual_seed(2)
    batches = [zipf(gen, (250,)) for _ in range(40)]
    with ThreadPoolExecutor(1) as executor:
        for step, ids in enumerate(batches):
            for cache in (fast, slow):
                cache.prefetch(step, ids, executor)
                if step % 4 == 2:  # an evaluation between: the read ahead is found again
                    cache.slots(batches[step - 1], training=False)
                cache.slots(ids, training=True, key=step)
            assert_same(state(fast), state(slow), f"after step {step}")
    assert fast.stats.prefetched > 0


def test_native_find_equals_torch_unique():
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 7, 300, 70_000, 3_000_000):
        slot_map = torch.randint(-1, 50, (rows,), generator=gen, dtype=torch.int32)
        for n in (0, 1, 2, 255, 4096):
            ids = torch.randint(0, rows, (n,), generator=gen)
            out = torch.empty(4, n, dtype=torch.int64)
            u, m = lib.find(ids.numpy(), slot_map.numpy(), *(out[i].numpy() for i in range(4)))
            unique, inverse = torch.unique(ids, return_inverse=True)
            slot = slot_map[unique].long()
            assert torch.equal(out[0, :u], unique)
            assert torch.equal(out[1], inverse)
            assert torch.equal(out[2, :u], slot)
            assert torch.equal(out[3, :m], unique[slot < 0])


@pytest.mark.parametrize("bad", [-1, 300])
def test_native_find_refuses_an_id_outside_the_table(bad):
    ids = torch.tensor([3, bad, 5])
    slot_map = torch.full((300,), -1, dtype=torch.int32)
    out = torch.empty(4, 3, dtype=torch.int64)
    with pytest.raises(IndexError, match=rf"id {bad} at 1 is outside the table's rows \[0, 300\)"):
        lib.find(ids.numpy(), slot_map.numpy(), *(out[i].numpy() for i in range(4)))


def test_native_victims_are_an_lru_lists_oldest():
    """Empty slots first, then the least recently used by an independent list, skipping
    stale queue entries and the lookup's own slots."""
    slots = 6
    last_used = torch.tensor([5, 2, 9, 4, 7, 3], dtype=torch.int64)
    # The queue holds every use in time order; (1, 1) and (3, 0) are stale.
    q_slots = torch.tensor([3, 1, 1, 5, 3, 0, 4, 2], dtype=torch.int64)
    q_stamps = torch.tensor([0, 1, 2, 3, 4, 5, 7, 9], dtype=torch.int64)
    protected = torch.zeros(slots, dtype=torch.bool)
    lookup = torch.tensor([-1, 5, -1], dtype=torch.int64)  # slot 5 is in use
    out = torch.empty(3, dtype=torch.int64)
    head, empty = lib.victims(
        lookup.numpy(), 3, 6, last_used.numpy(), protected.numpy(),
        q_slots.numpy(), q_stamps.numpy(), 0, 8, out.numpy(),
    )  # fmt: skip
    oldest = sorted((u, s) for s, u in enumerate(last_used.tolist()) if s != 5)
    assert out.tolist() == [s for _, s in oldest[:3]] == [1, 3, 0]
    assert (head, empty) == (6, 0)
    assert not protected.any()  # the scratch is left clear
    out = torch.empty(3, dtype=torch.int64)
    head, empty = lib.victims(
        lookup.numpy(), 3, 4, last_used.numpy(), protected.numpy(),
        q_slots.numpy(), q_stamps.numpy(), 0, 8, out.numpy(),
    )  # fmt: skip
    assert out.tolist() == [4, 5, 1] and (head, empty) == (3, 2)  # slots 4 and 5 are empty
    with pytest.raises(AssertionError, match="ran out of slots"):
        lib.victims(
            lookup.numpy(), 6, 6, last_used.numpy(), protected.numpy(),
            q_slots.numpy(), q_stamps.numpy(), 0, 8, torch.empty(6, dtype=torch.int64).numpy(),
        )  # fmt: skip
