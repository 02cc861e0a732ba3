"""Cached tables in sharded runs: each rank caches its own shards.

Two gloo ranks whose cached shards evict rows every step train exactly as the same
shards held in memory, and as one process with the full tables in memory (to the
golden tests' tolerance: the ranks sum gradients in another order); a checkpoint
of the cached shards resumes exactly. Column splits are refused by name. Under the
pipeline, each training step reads the next batch's missing rows of its shards in the
background, and the run still equals the in-memory one bit for bit.
"""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from dist_cases import gather_tables, local_slice, make_batch

from towerrec.config import load_config
from towerrec.data.batch import Batch
from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.compact import CompactConfig, build_embedding_collection
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.modules.tiers import TierConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sharding import ShardingPlan, ShardingType, plan_table
from towerrec.train.loop import _prefetches_rows
from towerrec.train.pipeline import pipelined

# "big" and "pair" run cached (more than MIN_ROWS rows), "small" stays in device memory.
TABLES = [
    TableConfig("big", 500, 8),
    TableConfig("pair", 1000, 8, feature_names=("p1", "p2"), pooling="mean"),
    TableConfig("small", 37, 4),
]
FEATURES = [f for t in TABLES for f in t.feature_names]
ROWS = {f: t.num_embeddings for t in TABLES for f in t.feature_names}
MIN_ROWS = 100
SEED = 5
BATCH = 4  # samples per rank and step


def _tier(path, backing="ssd") -> TierConfig:
    # A tenth of a shard's rows: enough for the most ids a step can bring a shard
    # (24 of big, 48 of pair), so few that rows are evicted (and written back to the
    # SSD file) every step once the cache is full.
    return TierConfig(
        "cached",
        cache_fraction=0.1,
        backing=backing,
        backing_path=str(path),
        cache_min_rows=MIN_ROWS,
    )


def _plan(kind: ShardingType, world: int) -> ShardingPlan:
    plans = {}
    for i, table in enumerate(TABLES):
        ranks = [i % world] if kind is ShardingType.TABLE_WISE else list(range(world))
        plans[table.name] = plan_table(table, kind, ranks)
    return ShardingPlan(world, 1, plans)


def _sharded(topology, kind, store, seed=SEED, backing="ssd"):
    """A sharded collection as distributed runs build it (``materialize=False``);
    cached over ``backing`` when ``store`` (a directory) is given."""
    lazy = build_embedding_collection(
        TABLES,
        CompactConfig(),
        EmbeddingOptimizerConfig(),
        materialize=False,
        tiers={},
        default_tier=_tier(store, backing) if store is not None else TierConfig(),
        backend="torch",
        seed=seed,
    )
    return ShardedEmbeddingBagCollection(lazy, _plan(kind, topology.world_size), Comm(topology))


def _train(sharded, topology, steps) -> None:
    for step in steps:
        _train_step(sharded, topology, _features(topology, step), step)


def _features(topology, step, per_rank=BATCH):
    """This rank's slice of global batch ``step`` (``per_rank`` samples a rank)."""
    world = topology.world_size
    batch = make_batch(step, per_rank * world, features=FEATURES, rows=ROWS)
    return local_slice(batch, topology.rank, world)


def _train_step(sharded, topology, features, step) -> torch.Tensor:
    world, rank = topology.world_size, topology.rank
    out = sharded(features).values()
    grad = torch.randn(BATCH * world, out.shape[1], generator=torch.Generator().manual_seed(step))
    out.backward(grad[rank * BATCH : (rank + 1) * BATCH])
    return out.detach()


def _equal(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _golden(topology, tmp_path):
    """Per sharding type: tables and state of the cached run, differences from the
    in-memory sharded run, and the cached shards' write-backs during training."""
    out = {}
    for kind in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        cached = _sharded(topology, kind, tmp_path / kind.value)
        local = cached._local
        assert local is None or isinstance(local, CachedEmbeddingBagCollection)
        memory = _sharded(topology, kind, None)
        _train(cached, topology, range(6))
        _train(memory, topology, range(6))
        written = {n: s.written_back for n, s in (local.cache_stats() if local else {}).items()}
        weights, states = gather_tables(cached)
        ref_weights, ref_states = gather_tables(memory)
        bad = _equal(weights, ref_weights) + _equal(states, ref_states)
        out[kind.value] = (weights, states, bad, written)
    return out


def _reference() -> tuple[dict, dict]:
    """The same 6 steps in one process with the full tables in memory."""
    world = 2
    ebc = EmbeddingBagCollection(TABLES, EmbeddingOptimizerConfig(), backend="torch", seed=SEED)
    for step in range(6):
        batch = make_batch(step, BATCH * world, features=FEATURES, rows=ROWS)
        out = ebc(batch).values()
        out.backward(
            torch.randn(BATCH * world, out.shape[1], generator=torch.Generator().manual_seed(step))
        )
    return ebc.table_weights(), ebc.optimizer_state_dict()


@pytest.mark.multiprocess
def test_cached_shards_train_like_tables_in_memory(tmp_path):
    results = spawn_world(_golden, 2, 1, tmp_path)
    ref_weights, ref_states = _reference()
    for rank, per_kind in enumerate(results):
        for kind, (weights, states, bad, written) in per_kind.items():
            assert bad == [], (rank, kind, bad)  # bit for bit the in-memory shards
            for name, w in ref_weights.items():
                torch.testing.assert_close(weights[name], w, rtol=0, atol=1e-5, msg=name)
            for key, s in ref_states.items():
                torch.testing.assert_close(states[key], s, rtol=0, atol=1e-5, msg=key)
            assert set(written) <= {"big", "pair"}
            if kind != "table_wise" or rank == 0:  # table-wise: rank 0 holds big
                assert written.get("big", 0) > 0, (rank, kind, written)  # evicted dirty rows
    assert {f.name for f in tmp_path.glob("row_wise/*.tstore")} == {
        "big.shard0.tstore",
        "big.shard1.tstore",
        "pair.shard0.tstore",
        "pair.shard1.tstore",
    }


PREFETCH_STEPS = 10


def _prefetched_run(topology, tmp_path):
    """Per sharding type and backing: what differed between the cached shards trained
    through the pipeline (rows read ahead) and the same shards in memory trained
    without it (pooled outputs each step, evaluations between steps, final tables and
    state, a step without a miss), and the rows each cached shard took from a read
    ahead. At step 4 the next batch is trained once out of turn and an evaluation
    then evicts rows: rows read ahead for it that were trained and written back
    since the read began are stale and must be read again."""
    out = {}
    for kind in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE):
        for backing in ("host", "ssd"):
            cached = _sharded(topology, kind, tmp_path / f"{kind.value}-{backing}", backing=backing)
            memory = _sharded(topology, kind, None)
            local = cached.cached_shards
            assert local is not None and local.caches
            stream = (
                Batch(torch.zeros(BATCH, 1), _features(topology, step), torch.zeros(BATCH))
                for step in range(PREFETCH_STEPS)
            )
            bad: list[object] = []
            misses = dict.fromkeys(local.caches, 0)
            for step, batch in enumerate(pipelined(cached, stream)):
                got = _train_step(cached, topology, batch.sparse, step)
                if not torch.equal(got, _train_step(memory, topology, batch.sparse, step)):
                    bad.append(("train", step))
                for name, stats in local.cache_stats().items():
                    if stats.misses <= misses[name]:
                        bad.append(("no miss", step, name))
                    misses[name] = stats.misses
                if step == 4:  # the next batch out of turn: its rows trained, then evicted
                    upcoming = _features(topology, step + 1)
                    _train_step(cached, topology, upcoming, 100)
                    _train_step(memory, topology, upcoming, 100)
                if step % 2 == 0:
                    with torch.no_grad():  # 16 times a step's rows: evicts most of a cache
                        features = _features(topology, 1000 + step, per_rank=16 * BATCH)
                        if not torch.equal(cached(features).values(), memory(features).values()):
                            bad.append(("eval", step))
            weights, states = gather_tables(cached)
            ref_weights, ref_states = gather_tables(memory)
            bad += _equal(weights, ref_weights) + _equal(states, ref_states)
            prefetched = {n: s.prefetched for n, s in local.cache_stats().items()}
            out[f"{kind.value}/{backing}"] = (bad, prefetched)
    return out


@pytest.mark.multiprocess
def test_shards_reading_rows_ahead_train_like_shards_in_memory(tmp_path):
    for rank, per_case in enumerate(spawn_world(_prefetched_run, 2, 1, tmp_path)):
        assert sorted(per_case) == [
            "row_wise/host",
            "row_wise/ssd",
            "table_wise/host",
            "table_wise/ssd",
        ]
        for case, (bad, prefetched) in per_case.items():
            assert bad == [], (rank, case, bad)
            # table-wise: rank 0 caches big, rank 1 pair; row-wise: both, a shard each
            tables = {"big", "pair"} if case.startswith("row_wise") else [{"big"}, {"pair"}][rank]
            assert set(prefetched) == set(tables), (rank, case, prefetched)
            assert all(n > 0 for n in prefetched.values()), (rank, case, prefetched)


@pytest.mark.parametrize("prefetch", [True, False])
def test_trainer_reads_sharded_rows_ahead_as_configured(tmp_path, prefetch):
    """``embedding.prefetch`` turns the pipeline on for sharded cached tables (their rows
    are read ahead under it) and sets the collections to match; without cached tables
    there is nothing to read ahead."""
    topology = Topology(world_size=1, hosts=1, rank=0)
    config = load_config(None, [f"embedding.prefetch={str(prefetch).lower()}"])
    cached = _sharded(topology, ShardingType.ROW_WISE, tmp_path)
    cached.prefetch_rows = not prefetch
    assert _prefetches_rows(config, torch.nn.Sequential(cached)) is prefetch
    assert cached.prefetch_rows is prefetch
    assert not _prefetches_rows(config, _sharded(topology, ShardingType.ROW_WISE, None))


@pytest.mark.parametrize(
    ("cpus", "others", "want"), [(3, True, True), (2, True, False), (3, False, False)]
)
def test_auto_reads_rows_ahead_where_every_rank_has_a_spare_core(
    tmp_path, monkeypatch, one_thread, caplog, cpus, others, want
):
    """``embedding.prefetch = auto`` (the default) reads ahead where this process's cores
    exceed its torch threads (2 here) and every other rank's do too (``others``), logged."""
    torch.set_num_threads(2)  # (one_thread restores the count)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    config = load_config(None, [])
    assert config.embedding.prefetch == "auto"
    cached = _sharded(Topology(world_size=1, hosts=1, rank=0), ShardingType.ROW_WISE, tmp_path)
    asked = []

    def all_agree(flag: bool) -> bool:
        asked.append(flag)
        return flag and others

    with caplog.at_level("INFO", logger="towerrec"):
        assert _prefetches_rows(config, torch.nn.Sequential(cached), all_agree) is want
    assert cached.prefetch_rows is want
    assert asked == [cpus > 2]
    said = "on" if cpus > 2 else "off"
    assert f"embedding.prefetch = auto: {said} ({cpus} cores for this process, 2 torch" in (
        caplog.text
    )


def _resume(topology, tmp_path):
    """Tables after 6 steps uninterrupted, and after 3, a checkpoint, a fresh collection
    (another seed, another store) loading it, and 3 more."""
    kind = ShardingType.ROW_WISE
    finals = []
    for resume in (False, True):
        sharded = _sharded(topology, kind, tmp_path / f"run{int(resume)}")
        _train(sharded, topology, range(3))
        if resume:
            state = {"model": sharded.state_dict(), "opt": sharded.optimizer_state_dict()}
            dcp.save(state, checkpoint_id=tmp_path / "checkpoint")
            _train(sharded, topology, range(3, 4))  # moves past the checkpoint: must not leak
            sharded = _sharded(topology, kind, tmp_path / "fresh", seed=SEED + 1)
            _train(sharded, topology, range(1))  # a cache holding rows the load replaces
            state = {"model": sharded.state_dict(), "opt": sharded.optimizer_state_dict()}
            dcp.load(state, checkpoint_id=tmp_path / "checkpoint")
            sharded.load_state_dict(state["model"])
            sharded.load_optimizer_state_dict(state["opt"])
        _train(sharded, topology, range(3, 6))
        finals.append(gather_tables(sharded))
    return finals


@pytest.mark.multiprocess
def test_cached_shards_resume_from_a_checkpoint_exactly(tmp_path):
    for rank, (uninterrupted, resumed) in enumerate(spawn_world(_resume, 2, 1, tmp_path)):
        for expected, got in zip(uninterrupted, resumed):
            assert set(expected) == set(got)
            for key, value in expected.items():
                assert torch.equal(got[key], value), (rank, key)


@pytest.mark.parametrize("kind", ["column_wise", "data_parallel"])
def test_cached_tables_refuse_other_sharding_types(tmp_path, kind):
    topology = Topology(world_size=1, hosts=1, rank=0)
    plans = {t.name: plan_table(t, ShardingType(kind), [0]) for t in TABLES}
    lazy = build_embedding_collection(
        TABLES,
        CompactConfig(),
        materialize=False,
        default_tier=_tier(tmp_path),
        backend="torch",
    )
    with pytest.raises(
        ValueError, match=f"table 'big' runs cached .* shards it '{kind}'.*row_wise"
    ):
        ShardedEmbeddingBagCollection(lazy, ShardingPlan(1, 1, plans), Comm(topology))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_two_ranks_cached_equal_two_ranks_in_memory(tmp_path):
    """``towerrec train --nproc 2`` with SSD-cached tables (the default plan, table-wise)
    ends with the validation AUC of the same run with every table in memory."""
    common = [
        "data.synthetic.num_embeddings=[30000,100,20000,50,500,200,100,200,40000]",
        "train.steps=8",
        "train.eval_every=0",
        "train.progress=false",
    ]
    cached = [
        "embedding.memory=cached",
        "embedding.cache_min_rows=1000",
        "embedding.backing=ssd",
        f"embedding.backing_path={tmp_path / 'store'}",
    ]
    aucs = []
    for name, sets in (("memory", common), ("cached", common + cached)):
        args = ["train", "--nproc", "2", "--out", str(tmp_path / name)]
        for s in sets:
            args += ["--set", s]
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr[-2000:]
        aucs.append(json.loads((tmp_path / name / "summary.json").read_text())["auc"])
    assert aucs[0] == aucs[1]
    # rank 0 writes the summary: the counts of tables cached on every rank
    cache = json.loads((tmp_path / "cached" / "summary.json").read_text())["cache"]
    assert sorted(cache["tables"]) == ["cat_0", "cat_2", "cat_8"]
    for counts in cache["tables"].values():
        assert counts["lookups"] == counts["hits"] + counts["misses"] > 0
        assert counts["rows_read"] >= counts["misses"] > 0
    assert cache["total"]["lookups"] == sum(c["lookups"] for c in cache["tables"].values())
    assert sorted(f.name for f in (tmp_path / "store").iterdir()) == [
        "cat_0.shard0.tstore",
        "cat_2.shard0.tstore",
        "cat_8.shard0.tstore",
    ]
