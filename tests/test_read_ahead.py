"""Reading a batch's missing rows ahead (``CachedEmbeddingBagCollection.prefetch``): each
read starts once the lookup before its batch is done, so in a pipelined run every miss
comes from the read-ahead and no row is read twice; a pipeline left with a batch read
ahead but never looked up (the end of an epoch) does not stop the next one reading
ahead; training equals the tables in memory bit for bit throughout, with the SSD
stores writing behind and without."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_cached_embedding import BATCH, TABLES, assert_same_tables, batches, cached, train_step

from towerrec.data.batch import Batch
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tiers import TierConfig
from towerrec.train.pipeline import pipelined


def totals(collection):
    stats = collection.cache_stats().values()
    return {
        "misses": sum(s.misses for s in stats),
        "rows_read": sum(s.rows_read for s in stats),
        "prefetched": sum(s.prefetched for s in stats),
    }


def epoch(reference, collection, steps, seed, stop=None):
    """Train ``steps`` batches pipelined (or stop before step ``stop``); the totals after
    each step."""
    model = torch.nn.Sequential(collection)
    stream = (Batch(torch.zeros(BATCH, 1), f, torch.zeros(BATCH)) for f in batches(steps, seed))
    after = []
    for step, batch in enumerate(pipelined(model, stream)):
        if step == stop:
            break  # the pipeline has read the next batch ahead: its lookup never comes
        assert torch.equal(
            train_step(reference, batch.sparse), train_step(collection, batch.sparse)
        )
        after.append(totals(collection))
    return after


@pytest.mark.parametrize(
    ("backing", "write_behind"), [("host", False), ("ssd", True), ("ssd", False)]
)
def test_every_miss_is_read_ahead_once(tmp_path, backing, write_behind):
    reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
    tier = TierConfig("cached", 0.1, backing=backing, backing_path=str(tmp_path / "store"))
    tier = replace(tier, write_behind=write_behind)
    collection = CachedEmbeddingBagCollection(
        TABLES,
        tiers={"b": replace(tier, cache_fraction=0.2), "c": TierConfig()},
        default=tier,
        backend="torch",
        seed=3,
    )
    stores = [cache.store for cache in collection.caches.values()]
    assert [s.writes_behind for s in stores] == [write_behind] * 2
    epoch(reference, collection, 50, seed=0)
    got = totals(collection)
    assert got["misses"] > 0
    assert got["rows_read"] == got["misses"] == got["prefetched"]
    assert all(s.written_back > 0 for s in collection.cache_stats().values())
    assert_same_tables(reference, collection)


def test_an_abandoned_read_ahead_does_not_stop_the_next_epochs(tmp_path):
    reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
    collection = cached(tmp_path, "ssd", c=TierConfig())
    before = epoch(reference, collection, 20, seed=0, stop=10)[-1]  # batch 10 read ahead
    first, *_, last = epoch(reference, collection, 20, seed=1)
    assert_same_tables(reference, collection)
    # The new epoch's first batch is looked up without its rows read ahead (batch 10's
    # read was in the way, and is dropped); from its second batch on, every miss is.
    assert first["prefetched"] == before["prefetched"] and first["misses"] > before["misses"]
    assert last["prefetched"] - first["prefetched"] == last["misses"] - first["misses"] > 0
