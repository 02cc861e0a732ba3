"""Sharded equals unsharded: every sharding type and a mixed plan on 2 and 4 gloo ranks.

For each plan, every rank runs 5 steps on its slice of a global batch while an
unsharded collection runs the global batch; the pooled outputs must match at
every step and the weights and optimizer state after the last one, with the ids
deduplicated on the wire (every sharding type, forced even where it saves nothing)
and not (the mixed plans). Every plan runs the default optimizer, row-wise Adagrad (column splits included: their
shards combine the row statistic), on both kernels; the mixed plan also runs
SGD and Adagrad.
"""

import pytest
import torch
from dist_cases import (
    SUM_TABLES,
    TABLES,
    gather_tables,
    local_slice,
    make_batch,
    plan_all,
    plan_mixed,
)

from towerrec.build.planning import build_plan
from towerrec.config import load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.id_wire import IdWire
from towerrec.distributed.launch import spawn_world
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sharding import ShardingType
from towerrec.sparse import KeyedJaggedTensor

BATCH = 6  # per rank
STEPS = 5
# FBGEMM kernels need shard widths that are multiples of 4: 4 column shards of 16+.
WIDE_TABLES = [
    TableConfig(t.name, t.num_embeddings, 4 * t.embedding_dim, t.feature_names, t.pooling)
    for t in TABLES
]


DEDUP = IdWire(True, where_smaller=False)  # every payload deduplicated, not only smaller ones
PLAIN = IdWire(False)


def _golden(topology, plan, optimizer, backend, weighted, seed, tables=None, wire=None):
    """Max abs differences (outputs, weights, states) between sharded and unsharded."""
    world, rank = topology.world_size, topology.rank
    opt = EmbeddingOptimizerConfig(kind=optimizer, lr=0.1)
    tables = tables or (SUM_TABLES if weighted else TABLES)
    features = [f for t in tables for f in t.feature_names]
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    reference = EmbeddingBagCollection(tables, opt, backend=backend, seed=seed)
    sharded = ShardedEmbeddingBagCollection(
        EmbeddingBagCollection(tables, opt, backend=backend, seed=seed),
        plan,
        Comm(topology),
        id_wire=wire,
    )
    out_diff = 0.0
    for step in range(STEPS):
        batch = make_batch(1000 * seed + step, BATCH * world, weighted, features, rows)
        grad = torch.randn(
            BATCH * world,
            sum(reference.embedding_dims),
            generator=torch.Generator().manual_seed(step),
        )
        expected = reference(batch).values()
        expected_rows = expected.detach()
        got = sharded(local_slice(batch, rank, world)).values()
        assert got.shape == (BATCH, expected.shape[1])
        lo = rank * BATCH
        out_diff = max(out_diff, float((got.detach() - expected_rows[lo : lo + BATCH]).abs().max()))
        expected.backward(grad)
        got.backward(grad[lo : lo + BATCH])
    weights, states = gather_tables(sharded)
    ref_states = reference.optimizer_state_dict()
    weight_diff = max(
        float((weights[name] - w).abs().max()) for name, w in reference.table_weights().items()
    )
    state_diff = max(
        (float((states[k] - v).abs().max()) for k, v in ref_states.items()), default=0.0
    )
    return out_diff, weight_diff, state_diff


def _measured_and_expected_bytes(topology, wire):
    """Bytes this rank sent in one table-wise step (1 id per bag, 3 distinct ids per
    feature), measured and by hand."""
    world, rank, batch = topology.world_size, topology.rank, BATCH
    plan = plan_all(ShardingType.TABLE_WISE, topology, SUM_TABLES)
    comm = Comm(topology)
    sharded = ShardedEmbeddingBagCollection(
        EmbeddingBagCollection(SUM_TABLES), plan, comm, id_wire=wire
    )
    features = [f for t in SUM_TABLES for f in t.feature_names]
    owner = {f: plan.tables[t.name].shards[0].rank for t in SUM_TABLES for f in t.feature_names}
    dim = {f: t.embedding_dim for t in SUM_TABLES for f in t.feature_names}
    ids = torch.arange(len(features) * batch) % 3
    kjt = KeyedJaggedTensor(features, ids, torch.ones(len(features) * batch, dtype=torch.int64))
    out = sharded(kjt).values()
    out.backward(torch.ones_like(out))
    expected = {"intra": 0, "cross": 0}
    for peer in range(world):
        if peer == rank:
            continue
        keys = sum(owner[f] == peer for f in features)
        sent = 5 * 8  # the count exchange: 5 int64 per peer
        if keys:  # header of 3 + 3 int32 per key, one-byte lengths, ids (< 256) of 1 byte
            sent += 4 * (3 + 3 * keys) + keys * batch
            # deduplicated (forced: it saves nothing with one-byte ids): 3 unique ids and a
            # one-byte index per id; else every id
            sent += keys * (3 + batch) if wire is DEDUP else keys * batch
        sent += sum(batch * dim[f] * 4 for f in features if owner[f] == rank)  # pooled
        sent += sum(batch * dim[f] * 4 for f in features if owner[f] == peer)  # gradients
        expected["cross" if topology.is_cross_host(peer) else "intra"] += sent
    return {"intra": comm.stats.intra_bytes, "cross": comm.stats.cross_bytes}, expected


def _rowwise_stat_bytes(topology):
    """Bytes of the row-statistic exchange in one column-wise step, measured and by hand:
    each shard sends (k - 1) x U floats for a table of k shards and U distinct ids."""
    world, rank = topology.world_size, topology.rank
    comm = Comm(topology)
    plan = plan_all(ShardingType.COLUMN_WISE, topology)
    ebc = EmbeddingBagCollection(TABLES, backend="torch")
    sharded = ShardedEmbeddingBagCollection(ebc, plan, comm)
    batch = make_batch(5, BATCH * world)
    out = sharded(local_slice(batch, rank, world)).values()
    out.backward(torch.ones_like(out))
    distinct = sum(
        torch.cat([batch[f].values for f in t.feature_names]).unique().numel() for t in TABLES
    )
    measured = comm.stats.intra.get("rowwise_stat", 0) + comm.stats.cross.get("rowwise_stat", 0)
    return measured, (world - 1) * distinct * 4


def _auto_plan(topology):
    """The default planner's plan (``plan.strategy = auto``) for the default config's
    tables, the default kernel and optimizer; it splits some tables by columns."""
    config = load_config(
        overrides=["plan.strategy=auto", "plan.stats_batches=1", f"plan.hosts={topology.hosts}"]
    )
    source = SyntheticSource(config.data.synthetic)
    plan = build_plan(config, source, topology.world_size)
    dim = config.model.embedding_dim
    tables = [TableConfig(f.name, f.num_embeddings, dim) for f in source.schema.sparse]
    assert any(tp.sharding is ShardingType.COLUMN_WISE for tp in plan.tables.values()), plan
    return _golden(topology, plan, "rowwise_adagrad", "auto", False, 11, tables=tables)


def _all_types(topology):
    """Every sharding type and the mixed plan with the default optimizer (row-wise
    Adagrad) on both kernels; the mixed plan also with SGD, Adagrad and dense Adam."""
    results = {
        f"bytes_{name}": _measured_and_expected_bytes(topology, wire)
        for name, wire in (("default", IdWire()), ("dedup", DEDUP), ("plain", PLAIN))
    }
    results["rowwise_stat_bytes"] = _rowwise_stat_bytes(topology)
    kinds = list(ShardingType)
    for i, kind in enumerate(kinds):
        plan = plan_all(kind, topology)
        backend = "torch" if i % 2 else "fbgemm"
        results[kind.value] = _golden(
            topology, plan, "rowwise_adagrad", backend, i == 2, seed=i, wire=DEDUP
        )
    for kind in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        plan = plan_all(kind, topology, WIDE_TABLES)
        results[f"{kind.value}_fbgemm"] = _golden(
            topology, plan, "rowwise_adagrad", "fbgemm", False, 9, tables=WIDE_TABLES
        )
    mixed, wide_mixed = plan_mixed(topology), plan_mixed(topology, WIDE_TABLES)
    for name, wire in (("dedup", DEDUP), ("plain", PLAIN)):
        results[f"mixed_rowwise_torch_{name}"] = _golden(
            topology, mixed, "rowwise_adagrad", "torch", True, 6, wire=wire
        )
    results["mixed_rowwise_fbgemm"] = _golden(
        topology, wide_mixed, "rowwise_adagrad", "fbgemm", False, 10, tables=WIDE_TABLES, wire=PLAIN
    )
    results["auto_plan"] = _auto_plan(topology)
    results["mixed_sgd"] = _golden(topology, mixed, "sgd", "torch", False, 7)
    results["mixed_adagrad"] = _golden(topology, mixed, "adagrad", "fbgemm", True, 8)
    # Every row moves every step, on shards whose rows the batch misses too.
    results["mixed_dense_adam"] = _golden(topology, mixed, "dense_adam", "torch", True, 12)
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,hosts", [(2, 1), (4, 2)])
def test_every_sharding_type_matches_unsharded(world, hosts):
    results = spawn_world(_all_types, world, hosts)
    for rank, per_plan in enumerate(results):
        assert per_plan is not None, f"rank {rank} returned nothing"
        for wire in ("default", "dedup", "plain"):
            measured, expected = per_plan.pop(f"bytes_{wire}")
            assert measured == expected, (rank, wire, measured, expected)
            assert (expected["cross"] > 0) == (hosts > 1)
        measured, expected = per_plan.pop("rowwise_stat_bytes")
        assert measured == expected > 0, (rank, measured, expected)
        for name, (out_diff, weight_diff, state_diff) in per_plan.items():
            assert out_diff < 1e-5, (rank, name, "outputs", out_diff)
            assert weight_diff < 1e-5, (rank, name, "weights", weight_diff)
            assert state_diff < 1e-5, (rank, name, "optimizer state", state_diff)
