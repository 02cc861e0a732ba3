"""Cached tables (``memory = 'cached'``): training through the cache equals training with
the tables in memory bit for bit; checkpoints hold full tables; stores refuse what they
were not written for."""

import errno
import os
import signal
import struct
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ROOT, needs_fbgemm, run_cli

from towerrec.build.models import build_model
from towerrec.config import ConfigError, load_config
from towerrec.modules import tiers as tiers_module
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.compact import build_embedding_collection
from towerrec.modules.compact_config import CompactConfig
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.ssd_store import HEADER_BYTES
from towerrec.modules.tables import TableConfig
from towerrec.modules.tier_store import StoreError
from towerrec.modules.tiers import TierConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor
from towerrec.workflows import training as trainer

TABLES = [
    TableConfig("a", 1000, 8, ("f0", "f1")),  # two features share it
    TableConfig("b", 500, 8),
    TableConfig("c", 40, 16),  # stays in device memory
]
ROWS = {"f0": 1000, "f1": 1000, "b": 500, "c": 40}
BATCH = 16


def batches(steps, seed=0, batch=BATCH):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(ROWS) * batch,), generator=gen)
        per_key = lengths.view(len(ROWS), batch).sum(1).tolist()
        values = torch.cat(
            [torch.randint(0, r, (n,), generator=gen) for r, n in zip(ROWS.values(), per_key)]
        )
        yield KeyedJaggedTensor(list(ROWS), values, lengths)


def train_step(collection, features):
    pooled = collection(features).values()
    # A loss that gives every bag its own gradient.
    (pooled * torch.arange(pooled.numel()).view_as(pooled).sin()).sum().backward()
    return pooled.detach()


def cached(tmp_path, backing="host", policy="lru", optimizer=None, backend="torch", **kw):
    # "ssd-io", "ssd-mapped": ssd stores read by io or through the mapping (embedding.ssd_reads)
    backing, _, reads = backing.partition("-")
    where = {"backing_path": str(tmp_path / "store"), "ssd_reads": reads or "auto"}
    tier = TierConfig("cached", 0.1, policy, backing, **where)
    return CachedEmbeddingBagCollection(
        TABLES,
        optimizer,
        tiers={"b": TierConfig("cached", 0.2, policy, backing, **where), **kw},
        default=tier,
        backend=backend,
        seed=3,
    )


def assert_same_tables(reference, collection):
    ref_w, got_w = reference.table_weights(), collection.table_weights()
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        assert got_w[name].shape == ref_w[name].shape
        assert torch.equal(ref_w[name], got_w[name]), name
    ref_s, got_s = reference.optimizer_state_dict(), collection.optimizer_state_dict()
    assert ref_s.keys() == got_s.keys()
    for key in ref_s:
        assert torch.equal(ref_s[key], got_s[key]), key


@pytest.mark.parametrize("backing", ["host", "ssd-io", "ssd-mapped"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("fbgemm", marks=needs_fbgemm)])
def test_cached_training_equals_device_bit_for_bit(tmp_path, backing, policy, backend):
    reference = EmbeddingBagCollection(TABLES, backend=backend, seed=3)
    collection = cached(tmp_path, backing, policy, backend=backend, c=TierConfig())
    assert set(collection.caches) == {"a", "b"}  # 100 and 100 slots; c in device memory
    if backing != "host":
        mapped = {c.store.mapped_reads for c in collection.caches.values()}
        assert mapped == {backing == "ssd-mapped"}
    misses = {name: 0 for name in collection.caches}
    for step, features in enumerate(batches(50)):
        expected, got = train_step(reference, features), train_step(collection, features)
        assert torch.equal(expected, got), step
        for name, stats in collection.cache_stats().items():
            assert stats.lookups - stats.hits > misses[name], f"no miss in {name} at {step}"
            misses[name] = stats.lookups - stats.hits
    assert all(s.written_back > 0 for s in collection.cache_stats().values())
    assert_same_tables(reference, collection)
    # evaluation (no autograd) after training: the same pooled values
    with torch.no_grad():
        for features in batches(3, seed=9):
            assert torch.equal(reference(features).values(), collection(features).values())


def test_prefetched_rows_equal_synchronous_fetch(tmp_path):
    """Through the training pipeline (the next batch's misses read in the background),
    with an evaluation between steps that evicts rows trained since the read began."""
    from towerrec.data.batch import Batch
    from towerrec.train.pipeline import pipelined

    reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
    collection = cached(tmp_path, "ssd", c=TierConfig())
    model = torch.nn.Sequential(collection)  # pipelined finds the collection inside a model
    stream = (Batch(torch.zeros(BATCH, 1), f, torch.zeros(BATCH)) for f in batches(40))
    for step, batch in enumerate(pipelined(model, stream)):
        assert torch.equal(
            train_step(reference, batch.sparse), train_step(collection, batch.sparse)
        )
        if step % 3 == 0:
            with torch.no_grad():
                (features,) = batches(1, seed=100 + step, batch=64)
                assert torch.equal(reference(features).values(), collection(features).values())
    assert all(s.prefetched > 0 for s in collection.cache_stats().values())
    assert_same_tables(reference, collection)


@pytest.mark.parametrize("kind", ["adagrad", "adam", "cf_sgd", "sgd"])
def test_cached_optimizer_state_moves_with_the_rows(tmp_path, kind):
    optimizer = EmbeddingOptimizerConfig(kind=kind, lr=0.1)
    reference = EmbeddingBagCollection(TABLES, optimizer, backend="torch", seed=3)
    collection = cached(tmp_path, "ssd", optimizer=optimizer, c=TierConfig())
    for features in batches(30):
        assert torch.equal(train_step(reference, features), train_step(collection, features))
    assert_same_tables(reference, collection)


def test_state_dict_is_the_full_table_and_loads_either_way(tmp_path):
    """A cached collection's checkpoint loads into a device one and back; training
    continues exactly."""
    reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
    collection = cached(tmp_path, "ssd", c=TierConfig())
    for features in batches(10):
        train_step(reference, features), train_step(collection, features)
    saved = {k: v.clone() for k, v in collection.state_dict().items()}
    saved_opt = {k: v.clone() for k, v in collection.optimizer_state_dict().items()}
    assert {k: v.shape for k, v in saved.items()} == {
        k: v.shape for k, v in reference.state_dict().items()
    }
    into_device = EmbeddingBagCollection(TABLES, backend="torch", seed=0)
    into_device.load_state_dict(saved)
    into_device.load_optimizer_state_dict(saved_opt)
    assert_same_tables(reference, into_device)
    into_cached = cached(tmp_path / "other", "host", policy="lfu", c=TierConfig())
    into_cached.load_state_dict(reference.state_dict())
    into_cached.load_optimizer_state_dict(reference.optimizer_state_dict())
    for features in batches(10, seed=1):
        expected = train_step(reference, features)
        assert torch.equal(expected, train_step(into_cached, features))
        assert torch.equal(expected, train_step(into_device, features))
    assert_same_tables(reference, into_cached)


RESUME = [
    "data.synthetic.num_embeddings=[3000, 30, 2000]",
    "data.synthetic.pooling_factors=[1, 2, 1]",
    "data.synthetic.eval_samples=2048",
    "train.batch_size=64",
    "train.eval_every=0",
    "train.log_every=5",
    "train.progress=false",
    "optimizer.warmup_steps=4",
    "embedding.backend=torch",
    "train.steps=16",
]


def resume_configs(tmp_path, *extra):
    """``RESUME`` (and ``extra``) with every table in memory, and the same with the tables
    above 100 rows cached at 10% over SSD files."""
    base = [*RESUME, *extra]
    cached = [
        "embedding.memory=cached",
        "embedding.cache_fraction=0.1",
        "embedding.cache_min_rows=100",
        "embedding.backing=ssd",
        f"embedding.backing_path={tmp_path / 'store'}",
    ]
    return load_config(None, base), load_config(None, [*base, *cached])


def test_cached_run_resumes_exactly_and_equals_the_device_run(tmp_path):
    """`memory = 'cached'` (SSD, 10% cache) stopped at step 6, resumed in device memory to
    step 11 and cached again to 16 ends with the same checkpoint as an uninterrupted run
    with every table in memory."""
    from test_trainer import final_state

    device, cached_run = resume_configs(tmp_path)
    full = trainer.train(device, tmp_path / "full")
    trainer.train(cached_run, tmp_path / "split", stop_after=6)
    # the layout may change on resume: a checkpoint holds full tables either way
    trainer.train(device, tmp_path / "split", resume=True, stop_after=11)
    resumed = trainer.train(cached_run, tmp_path / "split", resume=True)
    assert resumed["completed"] and resumed["steps"] == 16
    a, b = final_state(tmp_path / "full", device), final_state(tmp_path / "split", device)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["auc"] == full["auc"]


KILLED_IN_WRITE_BACK = """
import os, signal, sys, traceback
from pathlib import Path
from towerrec.config import load_config
from towerrec.modules.ssd_store import SsdStore
from towerrec.workflows import training as trainer

run, where, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
real_write = SsdStore.write

def write(self, rows, records):
    done = [p for p in (run / "checkpoint").glob("step_*") if not p.name.endswith(".partial")]
    caller = traceback.extract_stack(limit=2)[0].name  # _evict (in a step) or flush
    if done and caller == where:
        half = len(rows) // 2  # half of this write-back lands, then the kill
        real_write(self, rows[:half], records[:half])
        self.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real_write(self, rows, records)

SsdStore.write = write
trainer.train(load_config(None, overrides), run)
"""


@pytest.mark.parametrize(
    "where, partial",
    [("_evict", []), ("flush", ["step_00000010.partial"])],
    ids=["evicting-in-a-step", "flushing-for-the-next-checkpoint"],
)
def test_a_run_killed_during_write_back_resumes_with_nothing_lost(tmp_path, where, partial):
    """SIGKILL in the middle of a write-back to the SSD store after the step-5 checkpoint
    (an eviction inside a step, or the flush that starts the step-10 checkpoint): the
    resume from step 5 ends with the weights and optimizer state of an uninterrupted
    run with every table in memory."""
    from test_trainer import final_state

    device = [*RESUME, "train.checkpoint_every=5"]
    cached_run = [
        *device,
        "embedding.memory=cached",
        "embedding.cache_fraction=0.04",  # 120 and 80 slots: evictions from step 2 on
        "embedding.cache_min_rows=100",
        "embedding.backing=ssd",
        f"embedding.backing_path={tmp_path / 'store'}",
    ]
    run = tmp_path / "killed"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_WRITE_BACK, str(run), where, *cached_run],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    found = sorted(p.name for p in (run / "checkpoint").glob("step_*"))
    assert found == ["step_00000005", *partial]
    resumed = trainer.train(load_config(None, cached_run), run, resume=True)
    assert resumed["completed"] and resumed["steps"] == 16
    full = trainer.train(load_config(None, device), tmp_path / "full")
    config = load_config(None, device)
    a, b = final_state(tmp_path / "full", config), final_state(run, config)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["auc"] == full["auc"]


# ------------------------------------------------------------------ errors
def test_batch_larger_than_the_cache_names_table_and_fraction(tmp_path):
    collection = cached(
        tmp_path, c=TierConfig(), a=TierConfig("cached", 0.5), b=TierConfig("cached", 0.01)
    )
    (features,) = batches(1, batch=64)
    with pytest.raises(
        ValueError,
        match=r"table 'b'.*5 slots.*cache_slots\) to at least \d+.*cache_fraction to at least 0\.\d+",
    ):
        train_step(collection, features)
    with torch.no_grad():  # evaluation splits the batch until it fits
        reference = EmbeddingBagCollection(TABLES, backend="torch", seed=3)
        assert torch.equal(reference(features).values(), collection(features).values())


def test_store_for_another_shape_or_optimizer_is_refused(tmp_path):
    cached(tmp_path, "ssd", c=TierConfig())
    other = [TableConfig("a", 999, 8, ("f0", "f1")), *TABLES[1:]]
    tier = TierConfig("cached", 0.1, "lru", "ssd", str(tmp_path / "store"))
    with pytest.raises(StoreError, match=r"a\.tstore was written for table 'a' of 1000 rows"):
        CachedEmbeddingBagCollection(other, default=tier, tiers={"c": TierConfig()})
    adam = EmbeddingOptimizerConfig(kind="adam")
    with pytest.raises(StoreError, match=r"momentum1\[1\]\), not .*momentum1\[8\], momentum2"):
        CachedEmbeddingBagCollection(TABLES, adam, default=tier, tiers={"c": TierConfig()})


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda raw: b"XXXXXXXX" + raw[8:], "not a towerrec backing store"),
        (lambda raw: raw[:20] + bytes([raw[20] ^ 1]) + raw[21:], "checksum mismatch"),
        (lambda raw: raw[:8] + struct.pack("<I", 7) + raw[12:], "format version 7"),
    ],
    ids=["magic", "checksum", "version"],
)
def test_damaged_header_is_refused(tmp_path, damage, match):
    cached(tmp_path, "ssd", c=TierConfig())
    path = tmp_path / "store" / "a.tstore"
    raw = path.read_bytes()
    path.write_bytes(damage(raw[:HEADER_BYTES]) + raw[HEADER_BYTES:])
    with pytest.raises(StoreError, match=match):
        cached(tmp_path, "ssd", c=TierConfig())


def test_read_only_backing_path_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o555)
    try:
        with pytest.raises(StoreError, match=r"store is read-only.*writable directory"):
            cached(tmp_path, "ssd", c=TierConfig())
    finally:
        store.chmod(0o755)
    cached(tmp_path, "ssd", c=TierConfig())
    (store / "b.tstore").chmod(0o444)
    with pytest.raises(StoreError, match=r"b\.tstore is read-only"):
        cached(tmp_path, "ssd", c=TierConfig())


def test_a_disk_without_room_for_the_table_is_refused_before_training(tmp_path, monkeypatch):
    from towerrec.modules import ssd_store as tier_store

    real = tier_store.shutil.disk_usage
    monkeypatch.setattr(
        tier_store.shutil, "disk_usage", lambda p: real(p)._replace(free=HEADER_BYTES + 100)
    )
    with pytest.raises(
        StoreError, match=r"a\.tstore needs 39\.16 KiB but its disk has 4\.098 KiB free"
    ):
        cached(tmp_path, "ssd", c=TierConfig())
    assert not list((tmp_path / "store").iterdir())  # nothing half-made left behind
    monkeypatch.setattr(tier_store.shutil, "disk_usage", real)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_store.os, "posix_fallocate", full)
    with pytest.raises(
        StoreError, match=r"a\.tstore needs 39\.16 KiB .* embedding\.backing_path to a disk"
    ):
        cached(tmp_path, "ssd", c=TierConfig())
    assert not list((tmp_path / "store").iterdir())


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["embedding.memory=disk"], "embedding.memory = 'disk' is not one of"),
        (["embedding.cache_fraction=0"], "cache_fraction must be > 0"),
        (["embedding.cache_policy=fifo"], "embedding.cache_policy = 'fifo' is not one of"),
        (["embedding.memory=cached", "embedding.backing=ssd"], "needs embedding.backing_path"),
        (["embedding.memory=cached", "embedding.kind=hash"], "caches full tables"),
        (
            ["embedding.tables.cat_0.memory=cached", "embedding.tables.cat_0.kind=qr"],
            "cat_0: memory = 'cached' caches a full table",
        ),
        (["embedding.tables.cat_0.cache_fraction=-1"], "cache_fraction must be > 0"),
        (["embedding.cache_min_rows=-1"], "cache_min_rows must be >= 0"),
        (["embedding.ssd_reads=mmap"], "embedding.ssd_reads = 'mmap' is not one of"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


FILE_BYTES = (1000 + 500) * (8 + 1) * 4  # the cached tables' rows: a and b, row-wise Adagrad


@pytest.mark.parametrize(
    ("available", "want"), [(None, False), (2 * FILE_BYTES - 1, False), (2 * FILE_BYTES, True)]
)
def test_ssd_reads_auto_maps_the_files_where_they_fit_in_half_the_memory_available(
    tmp_path, monkeypatch, caplog, available, want
):
    monkeypatch.setattr(tiers_module, "available_memory_bytes", lambda: available)
    with caplog.at_level("INFO", logger="towerrec"):
        collection = cached(tmp_path, "ssd", c=TierConfig())
    stores = [c.store for c in collection.caches.values()]
    assert sum(s.layout.rows_bytes for s in stores) == FILE_BYTES
    assert {s.mapped_reads for s in stores} == {want}
    assert f"embedding.ssd_reads = auto: {'mapped' if want else 'io'}" in caplog.text
    # two processes on this machine, each with as many files: twice the bytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    halved = cached(tmp_path / "2", "ssd", c=TierConfig())
    assert {c.store.mapped_reads for c in halved.caches.values()} == {False}


def test_ssd_reads_as_set_are_kept_whatever_the_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(tiers_module, "available_memory_bytes", lambda: 1)
    where = {"backing_path": str(tmp_path), "ssd_reads": "mapped"}
    collection = CachedEmbeddingBagCollection(
        TABLES,
        tiers={"b": TierConfig("cached", 0.2, backing="ssd", **{**where, "ssd_reads": "io"})},
        default=TierConfig("cached", 0.1, backing="ssd", **where),
        seed=3,
    )
    assert collection.caches["a"].store.mapped_reads
    assert not collection.caches["b"].store.mapped_reads


def test_cache_as_large_as_the_table_warns_and_stays_in_device_memory():
    config = load_config(
        None,
        ["embedding.tables.cat_1.memory=cached", "embedding.tables.cat_1.cache_fraction=1.5"],
    )
    from towerrec.data.synthetic import SyntheticSource

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(config, SyntheticSource(config.data.synthetic).schema, "cpu")
    assert any(
        "holds the whole table; it is kept in device memory" in str(w.message) for w in caught
    )
    assert isinstance(model.sparse, EmbeddingBagCollection)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [
            "data.synthetic.num_embeddings=[30000,100,20000,50,500,200,100,200,40000]",
            "embedding.backing=ssd",
        ],
        ["--config", "configs/movielens.toml", "embedding.cache_fraction=0.3"],
    ],
    ids=["synthetic", "movielens"],
)
def test_cli_trains_cached(tmp_path, extra):
    args = ["train", "--out", str(tmp_path / "run")]
    if extra[0] == "--config":
        args += extra[:2]
        extra = extra[2:]
    sets = [
        *extra,
        "embedding.memory=cached",
        "embedding.cache_min_rows=1000",
        f"embedding.backing_path={tmp_path / 'store'}",
        "train.steps=12",
        "train.eval_every=0",
        "train.progress=false",
    ]
    for s in sets:
        args += ["--set", s]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").exists()


def test_sharded_runs_build_lazy_tables_that_remember_their_tiers():
    # Distributed runs build without tables; the shards are cached on their ranks
    # (tests/test_sharded_cached.py).
    config = load_config(None, ["embedding.memory=cached", "embedding.cache_fraction=0.5"])
    from towerrec.data.synthetic import SyntheticSource

    schema = SyntheticSource(config.data.synthetic).schema
    model = build_model(config, schema, torch.device("cpu"), materialize_embeddings=False)
    sparse = model.sparse
    assert isinstance(sparse, EmbeddingBagCollection) and not sparse.is_materialized
    assert sparse.tiers is not None and sparse.tiers["cat_1"].is_cached


@pytest.mark.slow
def test_bench_tiers_reports_each_variant():
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["tiers"].add_arguments(parser)
    args = parser.parse_args(
        ["--gib", "0.06", "--batch-size", "128", "--steps", "3", "--warmup", "2", "--dim", "8"]
    )
    result = BENCHMARKS["tiers"].run(args)
    assert set(result["results"]) == {"device", "host", "ssd"}
    for variant in ("host", "ssd"):
        stats = result["results"][variant]
        assert stats["cached_tables"] > 0 and 0 <= stats["hit_rate"] <= 1
    # each cached variant against all tables in memory and against its link-limited bound
    assert set(result["ratios"]) == {
        "host/device",
        "ssd/device",
        "host/link_bound",
        "ssd/link_bound",
    }
    assert set(result["ratios_median_round"]) == {"host/device", "ssd/device"}
    assert all(len(v) == 1 for v in result["ratios_by_round"].values())  # one round


def test_bench_tiers_runs_the_write_behind_and_the_read_ways_beside_the_synchronous_step(
    tmp_path,
):
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["tiers"].add_arguments(parser)
    argv = (
        "--gib 0.03 --batch-size 64 --steps 2 --warmup 1 --dim 8 --threads 2 "
        "--variants ssd-sync,ssd-write-behind,ssd-io"
    )
    result = BENCHMARKS["tiers"].run(parser.parse_args([*argv.split(), "--path", str(tmp_path)]))
    ran = {name: r["background"] for name, r in result["results"].items()}
    auto = len(os.sched_getaffinity(0)) > 2  # a core beyond the 2 torch threads
    # ssd_reads = auto maps files this small; ssd-io reads by io
    assert ran == {
        "ssd-sync": {"read_ahead": False, "write_behind": False, "mapped_reads": True},
        "ssd-write-behind": {"read_ahead": False, "write_behind": True, "mapped_reads": True},
        "ssd-io": {"read_ahead": auto, "write_behind": auto, "mapped_reads": False},
    }
    assert "ssd-write-behind/ssd-sync" in result["ratios"]
    for name, r in result["results"].items():
        assert 0 < r["train_peak_anon_mb"] <= r["train_peak_rss_mb"], name


def test_bench_tiers_pairs_each_round_with_the_in_memory_run_of_that_round():
    from towerrec.bench.tiers import round_ratios

    rounds = {"device": [100.0, 50.0, 80.0], "ssd": [60.0, 45.0, 40.0], "host": [90.0, 40.0, 80.0]}
    assert round_ratios(rounds) == {"ssd/device": [0.6, 0.9, 0.5], "host/device": [0.9, 0.8, 1.0]}
    assert round_ratios({"ssd": [1.0]}) == {}  # no in-memory run to pair with


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--variants", "ssd,mmap"], r"--nproc 2 runs the variants .* drop mmap"),
        (["--batch-size", "255"], r"--batch-size 255 is the global batch .* multiple of 2"),
    ],
)
def test_bench_tiers_on_ranks_refuses_what_it_cannot_run(extra, match):
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["tiers"].add_arguments(parser)
    args = parser.parse_args(["--nproc", "2", *extra])
    with pytest.raises(ValueError, match=match):
        BENCHMARKS["tiers"].run(args)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--device", "mps"], r"--device 'mps': use cpu or cuda"),
        pytest.param(
            ["--device", "cuda"],
            r"--device cuda needs a CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"),
        ),
    ],
)
def test_bench_tiers_refuses_a_device_it_cannot_train_on(extra, match):
    from towerrec.cli.bench import BENCHMARKS

    parser = __import__("argparse").ArgumentParser()
    BENCHMARKS["tiers"].add_arguments(parser)
    with pytest.raises(ValueError, match=match):
        BENCHMARKS["tiers"].run(parser.parse_args(extra))


def test_bench_tiers_gives_each_rank_its_slice_of_the_global_batch():
    from towerrec.bench.tiers import _rank_part
    from towerrec.data.batch import Batch

    (features,) = batches(1, seed=4, batch=12)
    batch = Batch(torch.arange(24.0).view(12, 2), features, torch.arange(12.0) % 2)
    parts = [_rank_part(batch, rank, 3) for rank in range(3)]
    assert [p.size for p in parts] == [4, 4, 4]
    assert torch.equal(torch.cat([p.dense for p in parts]), batch.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), batch.labels)
    for key in ROWS:
        assert torch.equal(torch.cat([p.sparse[key].values for p in parts]), features[key].values)
        assert torch.equal(torch.cat([p.sparse[key].lengths for p in parts]), features[key].lengths)


def test_cached_tables_asked_for_but_none_large_enough_is_warned():
    tables = [TableConfig("a", 100, 4), TableConfig("b", 60, 4)]
    cached = TierConfig(memory="cached", cache_min_rows=100)
    with pytest.warns(UserWarning, match=r"the largest, 'a', has 100: every table stays"):
        collection = build_embedding_collection(tables, CompactConfig(), default_tier=cached)
    assert isinstance(collection, EmbeddingBagCollection)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one row more than the threshold: cached, no warning
        build_embedding_collection(
            tables, CompactConfig(), default_tier=TierConfig(memory="cached", cache_min_rows=99)
        )
        build_embedding_collection(tables, CompactConfig())  # nothing asked: nothing said
