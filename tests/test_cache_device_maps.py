"""Cached tables whose bookkeeping runs beside the slot tables (``cache_maps = "device"``):
the path a GPU takes, run here with device="cpu". Training through it equals the tables
in memory bit for bit, and it picks the same victims as the host bookkeeping."""

import pytest
import test_kv_store as kv_tests
import torch
from test_cached_embedding import BATCH, TABLES, assert_same_tables, batches, train_step

from towerrec.build.models import build_model
from towerrec.config import load_config
from towerrec.data.batch import Batch
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tiers import CacheMaps, TierConfig
from towerrec.train.pipeline import pipelined


def cached(tmp_path, maps, backing="host", policy="lru", backend="torch"):
    """``test_cached_embedding.cached`` with the bookkeeping at ``maps``."""
    path = str(tmp_path / "store")
    return CachedEmbeddingBagCollection(
        TABLES,
        tiers={
            "b": TierConfig("cached", 0.2, policy, backing, path, cache_maps=maps),
            "c": TierConfig(),
        },
        default=TierConfig("cached", 0.1, policy, backing, path, cache_maps=maps),
        backend=backend,
        seed=3,
    )


def counts(collection):
    return {n: s.as_dict() for n, s in collection.cache_stats().items()}


@pytest.mark.parametrize(("backing", "policy"), [("host", "lru"), ("ssd", "lfu")])
def test_device_bookkeeping_equals_memory_and_the_host_bookkeeping(tmp_path, backing, policy):
    """50 steps with misses and write-backs every step: the same pooled values as every
    table in memory, bit for bit, and the same hits, reads and write-backs as the host
    bookkeeping (the same victims)."""
    reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
    device = cached(tmp_path / "d", "device", backing, policy)
    host = cached(tmp_path / "h", "host", backing, policy)
    assert all(c.on_device and c.recency is None for c in device.caches.values())
    assert not any(c.on_device for c in host.caches.values())
    misses = {name: 0 for name in device.caches}
    for step, features in enumerate(batches(50)):
        expected = train_step(reference, features)
        assert torch.equal(expected, train_step(device, features)), step
        assert torch.equal(expected, train_step(host, features)), step
        for name, stats in device.cache_stats().items():
            assert stats.misses > misses[name], f"no miss in {name} at {step}"
            misses[name] = stats.misses
        assert counts(device) == counts(host), step
    assert all(s.written_back > 0 for s in device.cache_stats().values())
    assert_same_tables(reference, device)
    with torch.no_grad():  # evaluation after training
        for features in batches(3, seed=9):
            assert torch.equal(reference(features).values(), device(features).values())


def test_device_bookkeeping_reads_ahead_through_the_pipeline(tmp_path):
    """The next batch's misses read ahead (synchronously on the CPU), with evaluations
    between steps that evict rows trained since the read: equal to memory, bit for bit."""
    reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
    collection = cached(tmp_path, "device", "ssd")
    stream = (Batch(torch.zeros(BATCH, 1), f, torch.zeros(BATCH)) for f in batches(40))
    for step, batch in enumerate(pipelined(torch.nn.Sequential(collection), stream)):
        expected = train_step(reference, batch.sparse)
        assert torch.equal(expected, train_step(collection, batch.sparse)), step
        if step % 3 == 0:
            with torch.no_grad():
                (features,) = batches(1, seed=100 + step, batch=64)
                assert torch.equal(reference(features).values(), collection(features).values())
    stats = collection.cache_stats().values()
    assert all(s.prefetched > 0 for s in stats)
    assert all(s.rows_read > s.misses for s in stats)  # stale read-aheads read again
    assert_same_tables(reference, collection)


def test_bookkeeping_moves_between_host_and_device_mid_run(tmp_path):
    """``place`` moves a cache's bookkeeping with its rows cached: training goes on bit for
    bit, and the host's LRU queue, rebuilt from the slots' last uses, picks the victims
    a cache that never moved picks."""
    reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
    moving = cached(tmp_path / "m", "host")
    still = cached(tmp_path / "s", "host")
    cpu = torch.device("cpu")
    for step, features in enumerate(batches(45)):
        if step in (15, 30):
            for cache in moving.caches.values():
                cache.place(step == 15, cpu)  # to the device path, then back to the host
        expected = train_step(reference, features)
        assert torch.equal(expected, train_step(moving, features)), step
        train_step(still, features)
        assert counts(moving) == counts(still), step
    assert_same_tables(reference, moving)


def test_kv_tables_with_device_bookkeeping_equal_a_host_cache(tmp_path):
    """Sorted-key maps (ids up to 2**63) on the device path: the same as a host-backed
    cache started from the same per-row init."""
    host = kv_tests.collection("host", tmp_path)
    kv_tests.init_host_per_row(host)
    tier = TierConfig(
        "cached",
        backing="kv",
        backing_path=str(tmp_path / "kv"),
        cache_slots=80,
        cache_maps="device",
    )
    kv = CachedEmbeddingBagCollection(
        kv_tests.TABLES,
        tiers={"c": TierConfig()},
        default=tier,
        backend="torch",
        seed=kv_tests.SEED,
    )
    assert all(c.on_device for c in kv.caches.values())
    for step, features in enumerate(kv_tests.batches(30)):
        assert torch.equal(
            kv_tests.train_step(host, features), kv_tests.train_step(kv, features)
        ), step
    assert all(s.written_back > 0 for s in kv.cache_stats().values())


def test_cache_maps_from_the_run_config(tmp_path):
    """``embedding.cache_maps`` reaches every cached table (a table may set its own);
    ``auto`` keeps the bookkeeping on the host for tables on the CPU; a bad value is
    refused naming the choices."""
    sets = ["embedding.memory=cached", "embedding.cache_fraction=0.2"]
    config = load_config(
        None, [*sets, "embedding.cache_maps=device", "embedding.tables.cat_1.cache_maps=host"]
    )
    from towerrec.data.synthetic import SyntheticSource

    schema = SyntheticSource(config.data.synthetic).schema
    sparse = build_model(config, schema, torch.device("cpu")).sparse
    assert isinstance(sparse, CachedEmbeddingBagCollection)
    on_device = {n: c.on_device for n, c in sparse.caches.items()}
    assert on_device["cat_1"] is False
    assert all(v for n, v in on_device.items() if n != "cat_1")
    auto = build_model(load_config(None, sets), schema, torch.device("cpu")).sparse
    assert isinstance(auto, CachedEmbeddingBagCollection)
    assert not any(c.on_device for c in auto.caches.values())
    assert CacheMaps.AUTO.on_device("cuda") and not CacheMaps.AUTO.on_device("cpu")
    assert CacheMaps.DEVICE.on_device("cpu") and not CacheMaps.HOST.on_device("cuda")
    with pytest.raises(ValueError, match=r"embedding\.cache_maps = 'gpu' is not one of"):
        load_config(None, [*sets, "embedding.cache_maps=gpu"])
