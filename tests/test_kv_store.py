"""Kv tables (``backing = 'kv'``): rows keyed by 64-bit id in an LMDB store, created on
first touch from their id. Training through one equals a host-backed cache whose rows
start from the same per-row init, bit for bit; a 2**40-row table trains and stores only
the rows it touched; checkpoints resume exactly, a killed run from its last checkpoint;
a store of another table, a damaged one, a read-only or full one are refused."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_cli

from towerrec.modules.cached import CachedEmbeddingBagCollection, TableBlock
from towerrec.modules.kv_store import KvStore
from towerrec.modules.tables import TableConfig, init_rows
from towerrec.modules.tier_store import RowLayout, StoreError
from towerrec.modules.tiers import TierConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.checkpoint import CheckpointError, CheckpointManager

TABLES = [
    TableConfig("a", 1000, 8, ("f0", "f1")),  # two features share it
    TableConfig("b", 500, 8),
    TableConfig("c", 40, 16),  # stays in device memory
]
ROWS = {"f0": 1000, "f1": 1000, "b": 500, "c": 40}
ROWS2 = {"f0": 1000, "f1": 1000, "b": 500}
BATCH = 16
SEED = 3


# Tiny kernels: two threads only add contention on a shared machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def batches(steps, seed=0, rows=ROWS, batch=BATCH):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(rows) * batch,), generator=gen)
        per_key = lengths.view(len(rows), batch).sum(1).tolist()
        values = torch.cat(
            [torch.randint(0, r, (n,), generator=gen) for r, n in zip(rows.values(), per_key)]
        )
        yield KeyedJaggedTensor(list(rows), values, lengths)


def train_step(collection, features):
    pooled = collection(features).values()
    (pooled * torch.arange(pooled.numel()).view_as(pooled).sin()).sum().backward()
    return pooled.detach()


def collection(backing, path, optimizer=None, tables=TABLES, slots=80):
    tier = TierConfig("cached", backing=backing, backing_path=str(path), cache_slots=slots)
    return CachedEmbeddingBagCollection(
        tables,
        optimizer,
        tiers={"c": TierConfig()},
        default=tier,
        backend="torch",
        seed=SEED,
    )


def init_host_per_row(host):
    """Start a host-backed cache's rows from ``init_rows``, as a kv store makes them."""
    for cache in host.caches.values():
        table = cache.table
        cache.store.initialize(
            lambda out, lo, hi, t=table: out.copy_(init_rows(t, SEED, torch.arange(lo, hi)))
        )
        cache.invalidate()


def touched(steps):
    ids = {"a": set(), "b": set()}
    for features in batches(steps):
        jagged = features.to_dict()
        ids["a"] |= set(jagged["f0"].values.tolist()) | set(jagged["f1"].values.tolist())
        ids["b"] |= set(jagged["b"].values.tolist())
    return ids


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_kv_training_equals_host_cache_bit_for_bit(tmp_path, kind):
    optimizer = EmbeddingOptimizerConfig(kind=kind, lr=0.1)
    host = collection("host", tmp_path, optimizer)
    init_host_per_row(host)
    kv = collection("kv", tmp_path / "kv", optimizer)
    assert set(kv.kv_stores) == {"a", "b"}
    for step, features in enumerate(batches(50)):
        assert torch.equal(train_step(host, features), train_step(kv, features)), step
    for name, stats in kv.cache_stats().items():
        assert stats.written_back > 0 and stats.misses > 50 * 10, name  # evicts every step
    kv.flush()
    for name, ids in touched(50).items():
        store = kv.kv_stores[name]
        assert store.ids().tolist() == sorted(ids)  # only the rows trained
        expected = host.table_weights()[name][store.ids()]
        assert torch.equal(store.read(store.ids())[:, :8], expected), name
        for key, state in host.optimizer_state_dict().items():
            columns = store.layout.state_columns()
            if key.startswith(f"embedding_bags.{name}.") and key.rsplit(".")[-1] in columns:
                col, width = columns[key.rsplit(".", 1)[1]]
                got = store.read(store.ids())[:, col : col + width]
                assert torch.equal(got, state[store.ids()].view(len(store), width)), key
    with torch.no_grad():  # evaluation, rows untouched by training made from their ids
        for features in batches(3, seed=9, batch=8):
            assert torch.equal(host(features).values(), kv(features).values())


def test_kv_table_of_2_40_rows_trains_and_stores_only_touched_rows(tmp_path):
    """Hashed 64-bit ids mod 2**40; the reference is a small host table holding, at
    row i, the initial row of the i-th distinct id."""
    rows = 1 << 40
    big = TableConfig("h", rows, 8, init_scale=0.05)
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(-(1 << 62), 1 << 62, (300,), generator=gen) % rows
    steps = [raw[torch.randint(0, 300, (40,), generator=gen)] for _ in range(30)]
    distinct = torch.unique(raw)
    small = TableConfig("h", distinct.numel(), 8, init_scale=0.05)
    kv = collection("kv", tmp_path, tables=[big], slots=50)
    host = collection("host", tmp_path, tables=[small], slots=50)
    host.caches["h"].store.records[:, :8] = init_rows(big, SEED, distinct)
    host.caches["h"].invalidate()
    lengths = torch.full((20,), 2)
    for ids in steps:
        local = torch.searchsorted(distinct, ids)
        got = train_step(kv, KeyedJaggedTensor(["h"], ids, lengths))
        assert torch.equal(got, train_step(host, KeyedJaggedTensor(["h"], local, lengths)))
    kv.flush()
    store = kv.kv_stores["h"]
    assert store.ids().tolist() == torch.unique(torch.cat(steps)).tolist()
    assert len(store) < distinct.numel() + 1
    with pytest.raises(StoreError, match=r"'h' is a kv table"):
        kv.table_weights()


class _Model(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.sparse = sparse
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, features):
        return self.sparse(features)


def _checkpoint(tmp_path, sparse):
    from towerrec.train.checkpoint import CheckpointManager

    model = _Model(sparse)
    return (
        model,
        torch.optim.SGD(model.linear.parameters(), lr=0.1),
        CheckpointManager(tmp_path / "ckpt"),
    )


def test_kv_checkpoint_resumes_exactly(tmp_path):
    stream = list(batches(20))
    straight = collection("kv", tmp_path / "a")
    expected = [train_step(straight, f) for f in stream]
    first = collection("kv", tmp_path / "b")
    model, optimizer, manager = _checkpoint(tmp_path, first)
    for features in stream[:10]:
        train_step(first, features)
    saved = manager.save(10, model, optimizer, {"step": 10})
    meta = json.loads((saved / "kv" / "sparse" / "a" / "store.json").read_text())
    assert meta["rows"] == len(first.kv_stores["a"]) > 0
    assert "embedding_bags.a.weight" not in model.state_dict()  # not materialised
    for features in stream[10:13]:
        train_step(first, features)  # written back after the checkpoint: not kept
    resumed = collection("kv", tmp_path / "c")
    model2, optimizer2, _ = _checkpoint(tmp_path, resumed)
    assert manager.load(saved, model2, optimizer2, {"step": 0})["step"] == 10
    for step, features in enumerate(stream[10:], 10):
        assert torch.equal(train_step(resumed, features), expected[step]), step
    # a damaged copy is refused: by the checkpoint's checksums, naming the file, and by
    # the store's own check where those are skipped (train.verify_checkpoints = false)
    data = saved / "kv" / "sparse" / "b" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"kv/sparse/b/data.mdb does not match"):
        manager.load(saved, model2, optimizer2, {"step": 0})
    unverified = CheckpointManager(manager.directory, verify=False)
    with pytest.raises(StoreError, match=r"table 'b' is damaged.*earlier checkpoint"):
        unverified.load(saved, model2, optimizer2, {"step": 0})


def test_kv_checkpoint_of_another_shape_or_without_stores_is_refused(tmp_path):
    first = collection("kv", tmp_path / "a")
    train_step(first, next(batches(1)))
    first.save_stores(tmp_path / "copy")
    wider = [TableConfig("a", 1000, 16, ("f0", "f1")), *TABLES[1:]]
    other = collection("kv", tmp_path / "b", tables=wider)
    with pytest.raises(StoreError, match=r"table 'a' of 1000 rows x 8.*config the run"):
        other.load_stores(tmp_path / "copy")
    with pytest.raises(StoreError, match=r"no store of kv table 'a'"):
        collection("kv", tmp_path / "c").load_stores(tmp_path / "nothing")


def _open(path, dim=8, states=(("momentum1", 1),), **table):
    layout = RowLayout("t", 1 << 40, dim, states)
    return KvStore(layout, path, TableConfig("t", 1 << 40, dim, **table), SEED)


def test_kv_store_of_another_table_shape_or_optimizer_is_refused(tmp_path):
    store = _open(tmp_path / "t.kvstore")
    store.write(torch.tensor([5]), torch.ones(1, 9))
    store.close()
    for kw, what in [
        ({"dim": 16, "states": (("momentum1", 1),)}, "16 float32"),
        ({"states": (("exp_avg", 8), ("exp_avg_sq", 8))}, "exp_avg"),
        ({"init": "normal"}, "init normal"),
    ]:
        with pytest.raises(StoreError, match=f"written for table 't'.*{what}.*delete it"):
            _open(tmp_path / "t.kvstore", **kw)
    assert torch.equal(_open(tmp_path / "t.kvstore").read(torch.tensor([5])), torch.ones(1, 9))


def test_damaged_read_only_or_full_kv_store_is_refused(tmp_path):
    path = tmp_path / "t.kvstore"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"not an lmdb file" * 1000)
    with pytest.raises(StoreError, match=r"table 't'.*damaged or not an LMDB store; delete"):
        _open(path)
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(StoreError, match=r"read-only.*writable"):
            _open(locked / "t.kvstore")
    finally:
        locked.chmod(0o755)
    layout = RowLayout("t", 1 << 40, 64, (("momentum1", 1),))
    small = KvStore(layout, tmp_path / "s.kvstore", TableConfig("t", 1 << 40, 64), 0, 1 << 20)
    with pytest.raises(StoreError, match=r"table 't'.*map size of 1 MiB.*last checkpoint"):
        for start in range(0, 100_000, 1000):
            small.write(torch.arange(start, start + 1000), torch.zeros(1000, 65))


_REOPEN = """
import sys
sys.path.insert(0, {tests!r})
from test_kv_store import _open
from towerrec.modules.tier_store import StoreError
try:
    _open({path!r})
except StoreError as e:
    print(e)
"""


def test_truncated_kv_store_is_refused_before_its_map_is_read(tmp_path):
    path = tmp_path / "t.kvstore"
    store = _open(path)
    store.write(torch.arange(2000), torch.ones(2000, 9))
    store.close()
    data = path / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    # In a child: reading past the file's end through the map is a SIGBUS, not an error.
    script = _REOPEN.format(tests=str(ROOT / "tests"), path=str(path))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    expected = f"table 't' is truncated ({data} has {size // 2} bytes, needs {size}); delete it"
    assert expected in done.stdout, done.stdout


def test_kv_config_and_unsupported_layouts_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"needs embedding.cache_slots"):
        TierConfig("cached", backing="kv", backing_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"'kv' needs embedding.backing_path"):
        TierConfig("cached", backing="kv", cache_slots=10)
    tier = TierConfig("cached", backing="kv", backing_path=str(tmp_path), cache_slots=10)
    with pytest.raises(StoreError, match=r"'a' is a kv table.*table-wise only.*rows \(0, 500\)"):
        CachedEmbeddingBagCollection(
            TABLES[:1],
            default=tier,
            blocks={"a": TableBlock(TABLES[0], (0, 500), (0, 8), "a.shard0")},
        )


_KILLED = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_kv_store import ROWS2, TABLES, batches, collection, train_step
from towerrec.modules.kv_store import KvStore
sparse = collection("kv", {path!r}, tables=TABLES[:2])
stream = list(batches(20, rows=ROWS2))
for f in stream[:10]:
    train_step(sparse, f)
sparse.save_stores({copy!r})
write = KvStore.write
def dying(self, rows, records):  # dies inside a write-back, half of its rows put
    half = rows.numel() // 2
    with self._env.begin(write=True, db=self._rows) as txn:
        for i in range(half):
            txn.put(int(rows[i]).to_bytes(8, "big"), records[i].numpy().tobytes())
        print("killing", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
for step, f in enumerate(stream[10:]):
    if step == 3:
        KvStore.write = dying
    train_step(sparse, f)
"""


def test_kv_run_killed_during_write_back_resumes_from_its_checkpoint(tmp_path):
    store, copy = tmp_path / "store", tmp_path / "copy"
    script = _KILLED.format(tests=str(ROOT / "tests"), path=str(store), copy=str(copy))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "killing" in done.stdout
    stream = list(batches(20, rows=ROWS2))  # kv tables only: the copy is the whole state
    straight = collection("kv", tmp_path / "straight", tables=TABLES[:2])
    expected = [train_step(straight, f) for f in stream]
    resumed = collection("kv", store, tables=TABLES[:2])  # the killed run's store, reopened
    resumed.load_stores(copy)
    for step, features in enumerate(stream[10:], 10):
        assert torch.equal(train_step(resumed, features), expected[step]), step
    resumed.flush()
    straight.flush()
    for name, kv in straight.kv_stores.items():
        ids = kv.ids()
        assert torch.equal(resumed.kv_stores[name].ids(), ids)
        assert torch.equal(resumed.kv_stores[name].read(ids), kv.read(ids))


def test_kv_config_keys_and_planner_refusal(tmp_path):
    from towerrec.build.planning import kv_tables, refuse_kv_tables
    from towerrec.config import ConfigError, load_config

    kv = ["embedding.memory=cached", "embedding.backing=kv", f"embedding.backing_path={tmp_path}"]
    with pytest.raises(ConfigError, match=r"needs embedding\.cache_slots"):
        load_config(None, kv)
    config = load_config(None, [*kv, "embedding.cache_slots=100", "embedding.tables.b.backing=ssd"])
    tables = [("a", 1 << 40), ("b", 1000), ("c", 50)]  # c: its cache would hold it all
    assert kv_tables(config, tables) == ["a"]
    with pytest.raises(ValueError, match=r"the planner does not handle kv tables.*'a' is one"):
        refuse_kv_tables(config, tables, "the planner")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_cli_trains_kv_tables_and_resumes_exactly(tmp_path, nproc):
    """``towerrec train`` (one process, and 2 ranks under ``plan.strategy = auto``) on a
    generated Criteo file hashed into 2**31-1 rows a table (the Criteo cache's int32
    ids), every table kv: one store and one checkpoint copy per table (on 2 ranks each
    on its owner only), and the run resumed from its step-10 checkpoint (the step-20 one
    removed, the stores as step 20 left them) ends with the metrics it first ended with."""
    from towerrec.data.criteo_gen import generate_criteo_file

    generate_criteo_file(tmp_path / "day_0", 3000, seed=1, file_index=0)
    done = run_cli(
        "data", "criteo", str(tmp_path / "day_0"), "--out", str(tmp_path / "cache"),
        "--num-embeddings", str((1 << 31) - 1), "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    common = [
        f"data.path={tmp_path / 'cache'}", "data.source=criteo", "train.steps=20",
        "train.batch_size=128", "train.checkpoint_every=10", "embedding.memory=cached",
        "embedding.backing=kv", "embedding.cache_slots=2048", "optimizer.warmup_steps=2",
        "train.progress=false",
    ]  # fmt: skip
    launch = ["--nproc", "2"] if nproc > 1 else []
    if nproc > 1:
        common += ["plan.strategy=auto", "plan.stats_batches=2"]
    sets = [*common, f"embedding.backing_path={tmp_path / 'kv'}"]
    args = [arg for key in sets for arg in ("--set", key)]
    run = tmp_path / "run"
    done = run_cli("train", *launch, *args, "--out", str(run), OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    straight = json.loads((run / "summary.json").read_text())
    tables = sorted(f"cat_{i}" for i in range(26))
    stores = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert stores == sorted(f"{t}.kvstore" for t in tables)
    saved = run / "checkpoint" / "step_00000010" / "kv" / "sparse"
    assert sorted(p.name for p in saved.iterdir()) == tables
    assert all((saved / t / "store.json").is_file() for t in tables)
    # stopped after step 10: its later checkpoint gone, the stores as step 20 left them
    shutil.rmtree(run / "checkpoint" / "step_00000020")
    done = run_cli("train", *launch, "--resume", "--out", str(run), OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"resumed from \S+ at step 10\b", done.stderr), done.stderr[-3000:]
    resumed = json.loads((run / "summary.json").read_text())
    for key in ("auc", "logloss", "ne"):
        assert resumed[key] == straight[key], key


def test_bench_tiers_kv_variant_sees_the_same_cache_traffic_as_host(tmp_path):
    import argparse

    from towerrec.bench.tiers import add_arguments, run_tiers_benchmark

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--gib", "0.02", "--dim", "8", "--batch-size", "256", "--min-rows", "50000",
         "--cache-fraction", "0.005", "--steps", "3", "--warmup", "3",
         "--variants", "host,kv", "--threads", "1", "--path", str(tmp_path)]
    )  # fmt: skip
    out = run_tiers_benchmark(args)
    host, kv = out["results"]["host"], out["results"]["kv"]
    assert kv["cached_tables"] > 0 and kv["rows_written_back"] > 0
    for key in ("hit_rate", "rows_read", "rows_written_back", "cache_rows", "cached_tables"):
        assert host[key] == kv[key], key
    cached_rows = sum(n for n in out["rows"] if n > 50000)
    assert 0 < kv["kv_rows_stored"] < cached_rows  # only rows written back are stored
