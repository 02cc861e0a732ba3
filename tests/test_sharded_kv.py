"""Kv tables (``backing = 'kv'``) in table-wise sharded runs: each kv table is whole on
its owner rank, which caches it over its own LMDB store (``<table>.kvstore``).

Two gloo ranks whose kv shards evict rows every step train bit for bit as the same
shards backed by host stores started from ``init_rows`` (the same sum order), and as
one process with the kv tables to the golden tests' tolerance (the ranks sum
gradients in another order). A checkpoint saved on 2 ranks (each owner saves its
stores) resumes exactly on 2 ranks, including a rank holding only a kv table under
Adam (its kernels' step); one process resumes it, and 2 ranks resume one process's. The planner places kv tables table-wise
at the size of their cache; a plan splitting one is refused by name.
"""

import pytest
import torch
from dist_cases import gather_tables, local_slice, make_batch
from test_sharded_cached import FEATURES, MIN_ROWS, ROWS, TABLES
from torch import nn

from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.compact import CompactConfig, build_embedding_collection
from towerrec.modules.tables import TableConfig, init_rows
from towerrec.modules.tiers import TierConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sharding import ShardingPlan, ShardingType, plan_table
from towerrec.train.checkpoint import CheckpointManager

# test_sharded_cached's tables: "big" and "pair" are kv tables (more than MIN_ROWS rows);
# "small" stays in device memory.
SLOTS = 50  # a step brings at most 24 ids of big, 48 of pair: evictions every step
SEED = 5
BATCH = 4  # samples per rank and step
WORLD = 2
STEPS = 12
ADAM = EmbeddingOptimizerConfig(kind="adam", lr=0.05)


def _tier(path, backing="kv") -> TierConfig:
    return TierConfig(
        "cached",
        cache_slots=SLOTS,
        backing=backing,
        backing_path=str(path),
        cache_min_rows=MIN_ROWS,
    )


def _plan(world: int, kind: ShardingType = ShardingType.TABLE_WISE) -> ShardingPlan:
    """Table-wise: big and small on rank 0, pair on rank 1 (a rank of kv tables only)."""
    ranks = {"big": 0, "pair": 1 % world, "small": 0}
    plans = {
        t.name: plan_table(
            t, kind, [ranks[t.name]] if kind is ShardingType.TABLE_WISE else range(world)
        )
        for t in TABLES
    }
    return ShardingPlan(world, 1, plans)


def _sharded(topology, store, backing="kv", optimizer=None, kind=ShardingType.TABLE_WISE):
    lazy = build_embedding_collection(
        TABLES,
        CompactConfig(),
        optimizer or EmbeddingOptimizerConfig(),
        materialize=False,
        tiers={},
        default_tier=_tier(store, backing),
        backend="torch",
        seed=SEED,
    )
    return ShardedEmbeddingBagCollection(lazy, _plan(topology.world_size, kind), Comm(topology))


def _one_process(store, optimizer=None) -> CachedEmbeddingBagCollection:
    return CachedEmbeddingBagCollection(
        TABLES, optimizer, default=_tier(store), backend="torch", seed=SEED
    )


def _grad(step: int, width: int) -> torch.Tensor:
    return torch.randn(BATCH * WORLD, width, generator=torch.Generator().manual_seed(step))


def _train_step(sharded, topology, step) -> torch.Tensor:
    rank = topology.rank
    batch = make_batch(step, BATCH * WORLD, features=FEATURES, rows=ROWS)
    out = sharded(local_slice(batch, rank, WORLD)).values()
    out.backward(_grad(step, out.shape[1])[rank * BATCH : (rank + 1) * BATCH])
    return out.detach()


def _one_process_step(collection, step) -> torch.Tensor:
    out = collection(make_batch(step, BATCH * WORLD, features=FEATURES, rows=ROWS)).values()
    out.backward(_grad(step, out.shape[1]))
    return out.detach()


def _stored(local: CachedEmbeddingBagCollection | None) -> dict[str, tuple]:
    """``{table: (ids, records)}`` of the rows in the kv stores of ``local`` (flushed)."""
    if local is None:
        return {}
    local.flush()
    return {n: (s.ids(), s.read(s.ids())) for n, s in local.kv_stores.items()}


def _dense(sharded) -> tuple[dict, dict]:
    """``gather_tables`` of the tables with dense rows (small; kv tables have none)."""
    weights, states = gather_tables(sharded)
    return {"small": weights["small"]}, states


def _kv_and_host(topology, tmp_path):
    """Kv shards and host-backed shards started from ``init_rows``, trained alike: the
    steps whose outputs differed, the kv stores' rows and the host stores' same rows,
    the write-backs, and the dense tables of both."""
    kv = _sharded(topology, tmp_path / "kv")
    host = _sharded(topology, tmp_path / "host", "host")
    local = host.cached_shards
    assert local is not None
    for cache in local.caches.values():  # rows from their ids, as a kv store makes them
        table = cache.table
        cache.store.initialize(
            lambda out, lo, hi, t=table: out.copy_(init_rows(t, SEED, torch.arange(lo, hi)))
        )
        cache.invalidate()
    bad = []
    for step in range(STEPS):
        if not torch.equal(_train_step(kv, topology, step), _train_step(host, topology, step)):
            bad.append(step)
    rows = _stored(kv.cached_shards)
    local.flush()
    host_rows = {n: local.caches[n].store.read(ids) for n, (ids, _) in rows.items()}
    written = {n: s.written_back for n, s in kv.cache_stats().items()}
    return bad, rows, host_rows, written, _dense(kv), _dense(host)


@pytest.mark.multiprocess
def test_kv_shards_train_like_host_shards_and_one_process(tmp_path):
    results = spawn_world(_kv_and_host, WORLD, 1, tmp_path)
    one = _one_process(tmp_path / "one")
    for step in range(STEPS):
        _one_process_step(one, step)
    reference = _stored(one)
    owners = {}
    for rank, (bad, rows, host_rows, written, dense, host_dense) in enumerate(results):
        assert bad == [], (rank, bad)
        assert set(rows) == [{"big"}, {"pair"}][rank]  # each kv table on its owner only
        assert set(written) == set(rows) and all(n > 0 for n in written.values()), written
        for name, (ids, records) in rows.items():
            owners[name] = rank
            assert torch.equal(records, host_rows[name]), name  # bit for bit
            ref_ids, ref_records = reference[name]
            assert torch.equal(ids, ref_ids), name  # the same rows touched, and no others
            torch.testing.assert_close(records, ref_records, rtol=0, atol=1e-5, msg=name)
        assert not any(".big." in k or ".pair." in k for k in dense[1])  # no dense kv state
        for got, expected in zip(dense, host_dense):
            assert set(got) <= set(expected)
            assert all(torch.equal(got[k], expected[k]) for k in got), rank
        torch.testing.assert_close(
            dense[0]["small"], one.dense_table_weights()["small"], rtol=0, atol=1e-5
        )
    assert owners == {"big": 0, "pair": 1}
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["big.kvstore", "pair.kvstore"]


class _Model(nn.Module):
    """Embeddings and a dense layer, as checkpoints see a model."""

    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.sparse = sparse
        self.dense = nn.Linear(1, 1)


def _checkpoint(model: _Model, directory, step: int):
    manager = CheckpointManager(directory)
    optimizer = torch.optim.SGD(model.dense.parameters(), lr=0.1)
    return manager, optimizer


def _resume(topology, tmp_path):
    """Under Adam: kv stores, dense tables and outputs of steps 3..5 of a run that went
    straight through, and of one that saved a checkpoint at step 3, went on (which must
    not leak), and was replaced by a fresh collection (another store, a dirty cache)
    loading it."""
    out = []
    for resume in (False, True):
        sharded = _sharded(topology, tmp_path / f"run{int(resume)}", optimizer=ADAM)
        for step in range(3):
            _train_step(sharded, topology, step)
        if resume:
            model = _Model(sharded)
            manager, optimizer = _checkpoint(model, tmp_path / "checkpoint", 3)
            path = manager.save(3, model, optimizer, {"step": torch.tensor(3)})
            _train_step(sharded, topology, 3)
            sharded = _sharded(topology, tmp_path / "fresh", optimizer=ADAM)
            _train_step(sharded, topology, 7)
            fresh = _Model(sharded)
            manager, optimizer = _checkpoint(fresh, tmp_path / "checkpoint", 3)
            manager.load(path, fresh, optimizer, {"step": torch.tensor(0)})
        outputs = [_train_step(sharded, topology, step) for step in range(3, 6)]
        out.append((outputs, _stored(sharded.cached_shards), _dense(sharded)))
    # Another world size: the checkpoint one process saved (a copy per table).
    sharded = _sharded(topology, tmp_path / "from-one", optimizer=ADAM)
    model = _Model(sharded)
    manager, optimizer = _checkpoint(model, tmp_path / "one-checkpoint", 3)
    manager.load(
        tmp_path / "one-checkpoint" / "step_00000003", model, optimizer, {"step": torch.tensor(0)}
    )
    for step in range(3, 6):
        _train_step(sharded, topology, step)
    out.append(_stored(sharded.cached_shards))
    return out


@pytest.mark.multiprocess
def test_kv_shard_checkpoints_resume_exactly_and_across_world_sizes(tmp_path):
    one = _one_process(tmp_path / "one-run", ADAM)
    for step in range(3):
        _one_process_step(one, step)
    model = _Model(one)
    manager, optimizer = _checkpoint(model, tmp_path / "one-checkpoint", 3)
    manager.save(3, model, optimizer, {"step": torch.tensor(3)})
    for step in range(3, 6):
        _one_process_step(one, step)
    one_run = _stored(one)
    results = spawn_world(_resume, WORLD, 1, tmp_path)
    saved = tmp_path / "checkpoint" / "step_00000003" / "kv" / "sparse"
    assert sorted(p.name for p in saved.iterdir()) == ["big", "pair"]  # one copy a table
    for rank, (straight, resumed, from_one) in enumerate(results):
        assert set(from_one) == [{"big"}, {"pair"}][rank]
        for name, (ids, records) in from_one.items():  # one process's checkpoint on 2 ranks
            assert torch.equal(ids, one_run[name][0]), name
            torch.testing.assert_close(records, one_run[name][1], rtol=0, atol=1e-5)
        for step, (a, b) in enumerate(zip(straight[0], resumed[0]), 3):
            assert torch.equal(a, b), (rank, step)
        assert set(straight[1]) == set(resumed[1]) == [{"big"}, {"pair"}][rank]
        for name, (ids, records) in straight[1].items():
            assert torch.equal(resumed[1][name][0], ids) and torch.equal(
                resumed[1][name][1], records
            ), (rank, name)
        for expected, got in zip(straight[2], resumed[2]):
            assert set(expected) == set(got)
            assert all(torch.equal(got[k], expected[k]) for k in got), rank
    # Another world size: one process loads the same checkpoint (a copy per table).
    one = _one_process(tmp_path / "one", ADAM)
    model = _Model(one)
    manager, optimizer = _checkpoint(model, tmp_path / "checkpoint", 3)
    manager.load(saved.parent.parent, model, optimizer, {"step": torch.tensor(0)})
    for step in range(3, 6):
        _one_process_step(one, step)
    stored = _stored(one)
    for straight, _, _ in results:
        for name, (ids, records) in straight[1].items():
            assert torch.equal(stored[name][0], ids), name
            torch.testing.assert_close(stored[name][1], records, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["row_wise", "table_row_wise", "column_wise"])
def test_a_plan_splitting_a_kv_table_is_refused(tmp_path, kind):
    topology = Topology(world_size=1, hosts=1, rank=0)
    with pytest.raises(
        ValueError, match=rf"table 'big' is a kv table .* shards it '{kind}'.*'table_wise' only"
    ):
        _sharded(topology, tmp_path, kind=ShardingType(kind))
    assert not any(tmp_path.iterdir())  # no store opened


def test_planner_places_kv_tables_whole_at_their_cache_size(tmp_path):
    from towerrec.build.planning import plan_source
    from towerrec.config import load_config
    from towerrec.planner.stats import TableStats

    config = load_config(
        None,
        [
            "embedding.memory=cached",
            "embedding.backing=kv",
            f"embedding.backing_path={tmp_path}",
            "embedding.cache_slots=4096",
            "embedding.tables.dense.memory=device",
        ],
    )
    stats = [
        TableStats(
            "huge", 1 << 40, 64, pooling_factor=2, pooling_p50=2, pooling_p99=2, pooling_max=2
        ),
        TableStats("wide", 1 << 36, 64),
        TableStats("dense", 1000, 64),
    ]
    result = plan_source(config, None, 2, stats)  # 2**40 rows of 64 floats: 256 TiB
    plan = result.plan
    for name in ("huge", "wide"):
        placed = plan.tables[name]
        assert placed.sharding is ShardingType.TABLE_WISE, name
        assert [s.rows for s in placed.shards] == [(0, 1 << (40 if name == "huge" else 36))]
    assert max(result.device_memory) < 1 << 30  # the caches' slots, not the id space
    plan.validate(
        [
            TableConfig("huge", 1 << 40, 64),
            TableConfig("wide", 1 << 36, 64),
            TableConfig("dense", 1000, 64),
        ]
    )


def test_planner_refuses_a_kv_cache_larger_than_a_device_by_name(tmp_path):
    from towerrec.build.planning import plan_source
    from towerrec.config import load_config
    from towerrec.planner.placement import PlanningError
    from towerrec.planner.stats import TableStats

    sets = ["embedding.memory=cached", "embedding.backing=kv", f"embedding.backing_path={tmp_path}"]
    config = load_config(
        None, [*sets, "embedding.cache_slots=50000000", "plan.device_memory_gib=1"]
    )
    stats = [TableStats("huge", 1 << 40, 64), TableStats("other", 1 << 40, 64)]
    with pytest.raises(
        PlanningError,
        match=r"kv table 'huge' .*table-wise only.*50,000,000 slots.*short by.*; lower embedding.cache_slots",
    ):
        plan_source(config, None, 2, stats)
