"""Shared pieces of the multi-process tests: tables, plans, batches, shard gathering."""

from __future__ import annotations

import torch
import torch.distributed as dist

from towerrec.distributed.mesh import Topology
from towerrec.modules.tables import TableConfig
from towerrec.sharding import ShardingPlan, ShardingType, plan_table
from towerrec.sparse import KeyedJaggedTensor

TABLES = [
    TableConfig("t0", 40, 8),
    TableConfig("t1", 30, 8, feature_names=("f1a", "f1b"), pooling="mean"),
    TableConfig("t2", 50, 16),
    TableConfig("t3", 23, 4),
    TableConfig("t4", 37, 8, pooling="mean"),
    TableConfig("t5", 12, 4),
]
# Per-id weights need sum pooling (mean of weighted ids is not defined by the kernels).
SUM_TABLES = [
    TableConfig(t.name, t.num_embeddings, t.embedding_dim, t.feature_names) for t in TABLES
]
FEATURES = [f for t in TABLES for f in t.feature_names]
ROWS = {f: t.num_embeddings for t in TABLES for f in t.feature_names}


def plan_all(kind: ShardingType, topology: Topology, tables=TABLES) -> ShardingPlan:
    """Every table sharded as ``kind``, spread over ranks (and hosts) round-robin."""
    world, hosts = topology.world_size, topology.hosts
    plans = {}
    for i, table in enumerate(tables):
        if kind is ShardingType.TABLE_WISE:
            ranks = [i % world]
        elif kind in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
            ranks = topology.host_ranks(i % hosts)
        else:
            ranks = list(range(world))
        plans[table.name] = plan_table(table, kind, ranks)
    return ShardingPlan(world, hosts, plans)


def plan_mixed(topology: Topology, tables=TABLES) -> ShardingPlan:
    world, hosts = topology.world_size, topology.hosts
    kinds = [
        ShardingType.TABLE_WISE,
        ShardingType.ROW_WISE,
        ShardingType.COLUMN_WISE,
        ShardingType.TABLE_ROW_WISE,
        ShardingType.TABLE_COLUMN_WISE,
        ShardingType.DATA_PARALLEL,
    ]
    plans = {}
    for i, (table, kind) in enumerate(zip(tables, kinds)):
        if kind is ShardingType.TABLE_WISE:
            ranks = [world - 1]
        elif kind in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
            ranks = topology.host_ranks((i + 1) % hosts)
        else:
            ranks = list(range(world))
        plans[table.name] = plan_table(table, kind, ranks)
    return ShardingPlan(world, hosts, plans)


def make_batch(seed: int, batch: int, weighted: bool = False, features=FEATURES, rows=ROWS):
    """A random jagged batch: 0..3 ids per bag (some bags empty)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(features) * batch,), generator=gen)
    values = []
    for i, f in enumerate(features):
        n = int(lengths[i * batch : (i + 1) * batch].sum())
        values.append(torch.randint(0, rows[f], (n,), generator=gen))
    values = torch.cat(values)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(features, values, lengths, weights)


def local_slice(kjt: KeyedJaggedTensor, rank: int, world: int) -> KeyedJaggedTensor:
    """Samples [rank*B, (rank+1)*B) of a global batch of world*B samples."""
    batch = kjt.stride() // world
    parts = {}
    from towerrec.sparse import Jagged

    for key in kjt.keys():  # noqa: SIM118 (a method, not a dict)
        jag = kjt[key]
        offsets = jag.offsets()
        lo, hi = int(offsets[rank * batch]), int(offsets[(rank + 1) * batch])
        parts[key] = Jagged(
            jag.values[lo:hi],
            jag.lengths[rank * batch : (rank + 1) * batch],
            jag.weights[lo:hi] if jag.weights is not None else None,
        )
    return KeyedJaggedTensor.from_jagged_dict(parts)


def gather_tables(sharded) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Full weights and optimizer state of every table, assembled from every rank's shards
    (a column-split table's row-wise state must be the same, bit for bit, on each of its
    column shards)."""
    mine = [
        (
            v.table,
            v.shard.rows,
            v.shard.cols,
            v.weight.clone(),
            {k: s.clone() for k, s in v.state.items()},
        )
        for v in sharded.shard_views()
    ]
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    weights, states, column_states = {}, {}, {}
    for table in sharded.tables:
        weights[table.name] = torch.full((table.num_embeddings, table.embedding_dim), float("nan"))
    for shards in everything:
        for name, (r0, r1), (c0, c1), w, state in shards:
            weights[name][r0:r1, c0:c1] = w
            for key, s in state.items():
                full_key = f"embedding_bags.{name}.{key}"
                table = next(t for t in sharded.tables if t.name == name)
                if s.dim() == 0:  # the kernels' step: the same everywhere
                    assert torch.equal(states.setdefault(full_key, s), s), (full_key, s)
                elif s.dim() == 1:
                    target = states.setdefault(
                        full_key, torch.full((table.num_embeddings,), float("nan"))
                    )
                    if c0 == 0:
                        target[r0:r1] = s
                    column_states.setdefault((full_key, r0, r1), []).append(s)
                else:
                    target = states.setdefault(
                        full_key,
                        torch.full((table.num_embeddings, table.embedding_dim), float("nan")),
                    )
                    target[r0:r1, c0:c1] = s
    for (key, _, _), shard_states in column_states.items():
        if not all(torch.equal(s, shard_states[0]) for s in shard_states):
            raise AssertionError(f"the column shards of {key} hold different row-wise states")
    return weights, states
