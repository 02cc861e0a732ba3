"""A cached table's counts (hits, misses, rows read and written back, bytes) equal an
independent LRU over the same stream of lookups, in the cache and in a run's summary."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch

from towerrec.config import load_config
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.table_cache import CacheStats, TableCache
from towerrec.modules.tables import TableConfig
from towerrec.modules.tiers import TierConfig
from towerrec.workflows import training as trainer


class LruList:
    """The cache's LRU rule, written independently: a lookup's distinct ids in id order;
    a miss takes an empty slot, else evicts the least recently used row not in the
    lookup (written back if a training lookup touched it since it was read)."""

    def __init__(self, slots: int, record_bytes: int) -> None:
        self.slots, self.record_bytes = slots, record_bytes
        self.rows: OrderedDict[int, bool] = OrderedDict()  # id -> dirty, oldest first
        self.lookups = self.hits = self.written = self.train_lookups = self.train_hits = 0

    def lookup(self, ids: list[int], training: bool) -> None:
        distinct = sorted(set(ids))
        missing = [i for i in distinct if i not in self.rows]
        self.lookups += len(distinct)
        self.hits += len(distinct) - len(missing)
        if training:
            self.train_lookups += len(distinct)
            self.train_hits += len(distinct) - len(missing)
        evict = len(self.rows) + len(missing) - self.slots
        keep = set(distinct)
        for victim in [i for i in self.rows if i not in keep][: max(evict, 0)]:
            self.written += self.rows.pop(victim)
        for i in distinct:
            self.rows[i] = self.rows.pop(i, False) or training

    def flush(self) -> None:
        self.written += sum(self.rows.values())
        self.rows = OrderedDict.fromkeys(self.rows, False)

    def expected(self) -> dict[str, int]:
        misses = self.lookups - self.hits
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": misses,
            "train_lookups": self.train_lookups,
            "train_hits": self.train_hits,
            "rows_written_back": self.written,
            "bytes_written": self.written * self.record_bytes,
        }


def zipf_ids(gen: torch.Generator, rows: int, n: int) -> list[int]:
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    return torch.multinomial(ranks**-1.05, n, replacement=True, generator=gen).tolist()


@pytest.mark.parametrize(
    ("backing", "maps"), [("host", "host"), ("ssd", "host"), ("host", "device")]
)
def test_cache_counts_equal_an_lru_list(tmp_path, backing, maps):
    """The host bookkeeping (a recency queue) and the device one (a top-k over the slots,
    here on the CPU) against the list."""
    table = TableConfig("t", 2000, 8)
    tier = TierConfig("cached", 0.05, "lru", backing, str(tmp_path / "store"), cache_maps=maps)
    collection = CachedEmbeddingBagCollection([table], tiers={"t": tier}, backend="torch")
    cache = collection.caches["t"]
    record_bytes = (8 + 1) * 4  # weight and row-wise Adagrad's state, float32
    sim = LruList(cache.cache_rows, record_bytes)
    gen = torch.Generator().manual_seed(0)
    for step in range(300):
        ids = zipf_ids(gen, table.num_embeddings, int(torch.randint(1, 90, (1,), generator=gen)))
        training = step % 7 != 3  # some lookups evaluate: their rows stay clean
        cache.slots(torch.tensor(ids), training)
        sim.lookup(ids, training)
        assert set(cache.id_of[cache.id_of >= 0].tolist()) == set(sim.rows), step  # same rows
        if step % 50 == 49:
            cache.flush()
            sim.flush()
    got = cache.stats.as_dict()
    assert {k: got[k] for k in sim.expected()} == sim.expected()
    assert sim.written > 0 and 0 < sim.hits < sim.lookups  # the stream exercises both
    # Without prefetching, every miss reads its row once.
    assert got["rows_read"] == got["misses"]
    assert got["bytes_read"] == got["misses"] * record_bytes


def test_counts_sum_over_ranks_field_by_field():
    a, b = CacheStats(36), CacheStats(36)
    a.lookups, a.hits, b.lookups, b.hits = 10, 4, 5, 5
    a.read(6)
    b.written(2)
    total = CacheStats.from_counts([x + y for x, y in zip(a.counts(), b.counts(), strict=True)])
    assert total.as_dict() == {
        "lookups": 15,
        "hits": 9,
        "misses": 6,
        "hit_rate": 0.6,
        "train_lookups": 0,
        "train_hits": 0,
        "train_hit_rate": 0.0,
        "rows_read": 6,
        "rows_written_back": 2,
        "rows_prefetched": 0,
        "bytes_read": 216,
        "bytes_written": 72,
    }
    with pytest.raises(ValueError, match="cache counts need 9 values"):
        CacheStats.from_counts([1, 2])


def test_run_summary_counts_equal_an_lru_over_the_lookups(tmp_path, monkeypatch, caplog):
    """A training run (prefetching, checkpoints, evaluations): summary.json's counts per
    table equal an LRU list replaying every lookup, flush and invalidation the caches saw."""
    events: dict[str, list[tuple]] = {}
    slot_counts: dict[str, int] = {}
    slots, flush, invalidate = TableCache.slots, TableCache.flush, TableCache.invalidate

    def spy_slots(self, ids, training, key=None):
        slot_counts[self.table.name] = self.cache_rows
        events.setdefault(self.table.name, []).append(("lookup", ids.flatten().tolist(), training))
        return slots(self, ids, training, key)

    def spy_flush(self):
        events.setdefault(self.table.name, []).append(("flush",))
        flush(self)

    def spy_invalidate(self):
        events.setdefault(self.table.name, []).append(("invalidate",))
        invalidate(self)

    monkeypatch.setattr(TableCache, "slots", spy_slots)
    monkeypatch.setattr(TableCache, "flush", spy_flush)
    monkeypatch.setattr(TableCache, "invalidate", spy_invalidate)
    config = load_config(
        None,
        [
            "data.synthetic.num_embeddings=[3000, 30, 2000]",
            "data.synthetic.pooling_factors=[1, 2, 1]",
            "data.synthetic.eval_samples=512",
            "train.batch_size=64",
            "train.eval_batch_size=256",
            "train.steps=16",
            "train.eval_every=8",
            "train.checkpoint_every=8",
            "train.progress=false",
            "embedding.backend=torch",
            "embedding.memory=cached",
            "embedding.cache_fraction=0.1",
            "embedding.cache_min_rows=100",
            "embedding.backing=ssd",
            f"embedding.backing_path={tmp_path / 'store'}",
            "embedding.prefetch=on",  # (auto: on or off by this machine's cores)
        ],
    )
    with caplog.at_level("INFO", logger="towerrec"):
        summary = trainer.train(config, tmp_path / "run")
    written = json.loads((tmp_path / "run" / "summary.json").read_text())["cache"]
    assert written == summary["cache"]
    tables = summary["cache"]["tables"]
    assert set(tables) == set(events) == {"cat_0", "cat_2"}  # cat_1 (30 rows) in memory
    for name, stream in events.items():
        record_bytes = (config.model.embedding_dim + 1) * 4
        sim = LruList(slot_counts[name], record_bytes)
        for event in stream:
            if event[0] == "lookup":
                sim.lookup(event[1], event[2])
            elif event[0] == "flush":
                sim.flush()
            else:
                sim.rows.clear()
        got = tables[name]
        assert {k: got[k] for k in sim.expected()} == sim.expected(), name
        assert sim.hits > 0 and sim.written > 0
        # Prefetches read a batch's rows missing when they start: at least the misses.
        assert got["rows_read"] >= got["misses"] and got["rows_prefetched"] > 0
        assert got["bytes_read"] == got["rows_read"] * record_bytes
    total = summary["cache"]["total"]
    assert total["lookups"] == sum(t["lookups"] for t in tables.values())
    assert total["bytes_written"] == sum(t["bytes_written"] for t in tables.values())
    assert any("cache cat_0: hit rate" in r.getMessage() for r in caplog.records)
