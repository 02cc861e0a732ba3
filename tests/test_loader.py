"""The cache loader: epoch coverage across ranks, determinism, resume, jagged gathers."""

import numpy as np
import pytest
import torch

from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.cache import ColumnStore, SplitColumns
from towerrec.data.loader import BLOCK, ColumnSource, LoaderConfig


def make_store(part_rows=(5000, 7000, 3001), eval_rows=1001, seed=0):
    """Rows whose dense[:, 0] is their global row id; one single-hot and one multi-hot feature."""
    rng = np.random.default_rng(seed)
    splits, start = {"train": [], "eval": []}, 0
    for split, sizes in (("train", part_rows), ("eval", (eval_rows,))):
        start = 0
        for n in sizes:
            ids = np.arange(start, start + n)
            lengths = rng.integers(0, 4, n)
            values = rng.integers(0, 50, int(lengths.sum()))
            splits[split].append(
                SplitColumns.from_arrays(
                    (ids % 2).astype(np.float32),
                    np.stack([ids, ids * 2], axis=1).astype(np.float32),
                    (ids % 97)[:, None].astype(np.int32),
                    {"bag": (values.astype(np.int32), lengths.astype(np.int32))},
                )
            )
            start += n
    schema = DataSchema(2, (SparseFeature("single", 97), SparseFeature("bag", 50, 1.5)))
    return ColumnStore(schema, ["single"], ["bag"], splits)


def row_ids(batch):
    return batch.dense[:, 0].long().tolist()


def reference_bags(store, split, rows):
    """Each row's bag, looked up the slow way."""
    out, start = [], 0
    lookup = {}
    for part in store.splits[split]:
        values, offsets = part.multi["bag"]
        for i in range(part.rows):
            lookup[start + i] = values[offsets[i] : offsets[i + 1]].tolist()
        start += part.rows
    for r in rows:
        out.append(lookup[r])
    return out


def test_one_epoch_across_ranks_reads_every_row_once():
    store = make_store()
    source = ColumnSource(store, LoaderConfig(dense="none", seed=3))
    n, batch_size, world = source.train_rows, 128, 3
    seen = []
    steps = n // (batch_size * world)
    for rank in range(world):
        stream = source.train_batches(batch_size, rank=rank, world_size=world)
        seen.append([r for _, b in zip(range(steps), stream) for r in row_ids(b)])
    flat = [r for rank_rows in seen for r in rank_rows]
    assert len(flat) == len(set(flat)) == steps * batch_size * world
    # The rows left over are the epoch's tail: the next global batch starts with them.
    rest = set(range(n)) - set(flat)
    nxt = [row_ids(source.train_batch(steps, batch_size, r, world)) for r in range(world)]
    tail = [r for rows in nxt for r in rows][: len(rest)]
    assert set(tail) == rest


def test_order_is_shuffled_deterministic_and_local():
    store = make_store()
    a = ColumnSource(store, LoaderConfig(dense="none", seed=1))
    b = ColumnSource(store, LoaderConfig(dense="none", seed=1))
    c = ColumnSource(store, LoaderConfig(dense="none", seed=2))
    first = row_ids(a.train_batch(0, 512))
    assert first == row_ids(b.train_batch(0, 512)) and first != row_ids(c.train_batch(0, 512))
    assert first != sorted(first)
    assert len({r // BLOCK for r in first}) <= 2  # block shuffle: reads stay local
    plain = ColumnSource(store, LoaderConfig(dense="none", shuffle=False))
    assert row_ids(plain.train_batch(1, 100)) == list(range(100, 200))
    # A new epoch has a new order.
    n = a.train_rows
    assert a.train_rows_of(0, 50).tolist() != a.train_rows_of(n, 50).tolist()
    assert sorted(a.train_rows_of(n, n).tolist()) == list(range(n))


def test_rank_slices_equal_the_global_batch_and_resume_continues():
    source = ColumnSource(make_store(), LoaderConfig(dense="none", seed=5))
    batch_size, world = 64, 4
    for index in (0, 7, 300):  # 300 crosses into the second epoch
        whole = source.train_batch(index, batch_size * world)
        parts = [source.train_batch(index, batch_size, r, world) for r in range(world)]
        assert row_ids(whole) == [r for p in parts for r in row_ids(p)]
    full = source.train_batches(batch_size, rank=1, world_size=world)
    expected = [row_ids(next(full)) for _ in range(12)][5:]
    resumed = source.train_batches(batch_size, start_batch=5, rank=1, world_size=world)
    assert [row_ids(next(resumed)) for _ in range(7)] == expected


def test_batches_carry_the_right_columns_and_bags():
    store = make_store()
    source = ColumnSource(store, LoaderConfig(dense="none", seed=0))
    batch = source.train_batch(3, 700)  # spans parts
    rows = row_ids(batch)
    batch.check()
    assert batch.sparse.keys() == ["single", "bag"]
    np.testing.assert_array_equal(batch.dense[:, 1].numpy(), np.array(rows) * 2)
    np.testing.assert_array_equal(batch.labels.numpy(), np.array(rows) % 2)
    assert batch.sparse["single"].values.tolist() == [r % 97 for r in rows]
    bag = batch.sparse["bag"]
    bags = reference_bags(store, "train", rows)
    assert bag.lengths.tolist() == [len(b) for b in bags]
    assert bag.values.tolist() == [v for b in bags for v in b]
    assert batch.sparse.values().dtype == torch.int64


def test_eval_ranks_cover_the_eval_split_once():
    store = make_store(eval_rows=1001)
    source = ColumnSource(store, LoaderConfig(dense="none"))
    rows = []
    for rank in range(3):
        for batch in source.eval_batches(100, rank=rank, world_size=3):
            rows.extend(row_ids(batch))
            bags = reference_bags(store, "validation", row_ids(batch))
            assert batch.sparse["bag"].values.tolist() == [v for b in bags for v in b]
    assert rows == list(range(1001))


def test_bad_arguments():
    store = make_store()
    with pytest.raises(ValueError, match="rank 3 is not in"):
        next(ColumnSource(store).train_batches(8, rank=3, world_size=3))
    empty = ColumnStore(store.schema, ["single"], ["bag"], {"train": store.splits["train"]})
    with pytest.raises(ValueError, match="no validation rows"):
        next(ColumnSource(empty).eval_batches(8))
    with pytest.raises(ValueError, match="preprocess it with a validation split"):
        ColumnSource(empty, require_eval=True)
    with pytest.raises(ValueError, match="no training rows"):
        ColumnSource(ColumnStore(store.schema, ["single"], ["bag"], {}))
    with pytest.raises(ValueError, match="num_workers"):
        LoaderConfig(num_workers=-1)


@pytest.mark.multiprocess
def test_worker_processes_deliver_the_same_stream():
    store = make_store()
    plain = ColumnSource(store, LoaderConfig(dense="none", seed=4))
    pooled = ColumnSource(store, LoaderConfig(dense="none", seed=4, num_workers=2, prefetch=2))
    expected = plain.train_batches(100, start_batch=3, rank=1, world_size=2)
    stream = pooled.train_batches(100, start_batch=3, rank=1, world_size=2)
    for _ in range(9):
        a, b = next(expected), next(stream)
        assert row_ids(a) == row_ids(b)
        assert torch.equal(a.sparse.values(), b.sparse.values())
        assert torch.equal(a.sparse.lengths(), b.sparse.lengths())
        assert b.sparse.keys() == ["single", "bag"]
    stream.close()  # stops and joins the workers


@pytest.mark.parametrize("num_workers", [0, pytest.param(1, marks=pytest.mark.multiprocess)])
def test_a_negative_id_in_the_cache_is_refused_where_ids_enter_the_embeddings(num_workers):
    """A corrupt cache: the loader and its workers build batches without per-id checks,
    so the embedding collection must refuse the id before a kernel reads the row."""
    from towerrec.modules.embedding_bag import EmbeddingBagCollection
    from towerrec.modules.tables import TableConfig

    rows = 64
    single = (np.arange(rows) % 97)[:, None].astype(np.int32)
    single[10, 0] = -5
    part = SplitColumns.from_arrays(
        np.zeros(rows, np.float32),
        np.zeros((rows, 2), np.float32),
        single,
        {"bag": (np.ones(rows, np.int32), np.ones(rows, np.int32))},
    )
    store = make_store()
    store = ColumnStore(store.schema, ["single"], ["bag"], {**store.splits, "train": [part]})
    source = ColumnSource(store, LoaderConfig(dense="none", shuffle=False, num_workers=num_workers))
    tables = [TableConfig(f.name, f.num_embeddings, 4) for f in store.schema.sparse]
    ebc = EmbeddingBagCollection(tables, backend="torch")
    stream = source.train_batches(32)
    with pytest.raises(ValueError, match=r"id -5 of feature 'single' \(sample 10\).*97 rows"):
        ebc(next(stream).sparse)
    stream.close()
