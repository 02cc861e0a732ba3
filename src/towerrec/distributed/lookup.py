"""The lookup stage of the sharded collection: this rank's shards and replicas as kernels.

::

    plan + this rank's slots ─► one EmbeddingBagCollection of shard tables
                                (rows r0..r1 x cols c0..c1 of each table; pooling
                                from the table's sharding type: partial sums under
                                a row split), fused kernels, optimizer in backward
    data-parallel tables     ─► one EmbeddingBagCollection of full replicas

A shard is filled from the full collection when it holds its tables, else from
the tables' seeded init one block at a time (``fill_table_block``), so no rank
ever holds a full table (replicas excepted).

Cached tables (``ebc.tiers``: each table's ``TablePlacement``, decided on the full
tables when the collection was built; ``modules/cached.py``): this rank's shards are one
``CachedEmbeddingBagCollection`` whose cached shard tables keep their rows in a
backing store of the shard's own (``<table>.shard<k>.tstore``), initialised as
the block of the full table; table-wise and row-wise shards only. A kv table
(``backing = "kv"``) shards table-wise only: its owner rank keeps the table's own
store (``<table>.kvstore``), rows created on first touch as in one process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from towerrec.distributed.input_dist import Slot
from towerrec.modules.cached import CachedEmbeddingBagCollection, TableBlock
from towerrec.modules.embedding_bag import EmbeddingBagCollection, IdPolicy
from towerrec.modules.kernels import Backend
from towerrec.modules.table_state import table_key, table_states
from towerrec.modules.tables import TableConfig, fill_table_block
from towerrec.sharding import Shard, ShardingPlan, ShardingType, strategy_for

__all__ = [
    "CACHED_SHARDINGS",
    "ShardView",
    "build_local",
    "build_replica",
    "copy_tables",
    "kernel_steps",
    "kv_shard_tables",
    "replica_views",
    "shard_views",
]


@dataclass(frozen=True)
class ShardView:
    """One shard stored on this rank: views of its weights and optimizer state."""

    table: str
    shard: Shard
    weight: torch.Tensor  # [rows, cols]
    state: dict[str, torch.Tensor]  # canonical name -> [rows] or [rows, cols]


# Sharding types whose shards a rank can cache: whole row ranges of a table.
CACHED_SHARDINGS = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)

Local = EmbeddingBagCollection | CachedEmbeddingBagCollection


def cached_shard_tables(
    ebc: EmbeddingBagCollection, tables: Sequence[TableConfig], plan: ShardingPlan
) -> set[str]:
    """The tables of ``tables`` whose shards run cached (``ebc.tiers``: the same on every
    rank); an error names a cached table that ``plan`` shards in a way that cannot be
    cached, and the types that can."""
    if ebc.tiers is None:
        return set()
    cached = {t.name for t in tables if ebc.tiers[t.name].is_cached}
    kv = kv_shard_tables(ebc, cached)
    for name in sorted(cached):
        kind = plan.tables[name].sharding
        if name in kv and kind is not ShardingType.TABLE_WISE:
            raise ValueError(
                f"table {name!r} is a kv table (embedding.backing = 'kv': rows keyed by id, "
                f"created on first touch) but the plan shards it {kind.value!r}; a kv table "
                "is sharded 'table_wise' only (whole on one rank): plan it table-wise "
                "(plan.strategy = 'auto' does; under 'none', distributed.sharding = "
                "'table_wise'), or set its backing to 'ssd' to split it"
            )
        if kind not in CACHED_SHARDINGS:
            supported = ", ".join(repr(k.value) for k in CACHED_SHARDINGS)
            raise ValueError(
                f"table {name!r} runs cached (memory = 'cached') but the plan shards it "
                f"{kind.value!r}; cached tables can be sharded {supported}: plan it one of "
                "those ways, or keep it in device memory (memory = 'device')"
            )
    return cached


def kv_shard_tables(ebc: EmbeddingBagCollection, cached: set[str]) -> set[str]:
    """The tables of ``cached`` (``cached_shard_tables``) that are kv tables."""
    if ebc.tiers is None:
        return set()
    return {name for name in cached if ebc.tiers[name].is_kv}


def copy_tables(
    ebc: EmbeddingBagCollection,
    tables: Sequence[TableConfig],
    *,
    id_policy: IdPolicy | None = None,
    materialize: bool | None = None,
) -> EmbeddingBagCollection:
    """A collection of ``tables`` (a subset of ``ebc``'s) with ``ebc``'s settings (or
    ``id_policy``), weights and optimizer state. When ``ebc`` does not hold its tables,
    the copy initialises itself from the same seed, as ``ebc`` would, if ``materialize``
    (default: as ``ebc``)."""
    subset = EmbeddingBagCollection(
        list(tables),
        ebc.optimizer,
        backend=ebc.backend,
        device=ebc.device,
        id_policy=ebc.id_policy if id_policy is None else id_policy,
        seed=ebc.seed,
        materialize=ebc.is_materialized if materialize is None else materialize,
    )
    if not ebc.is_materialized:
        return subset
    weights, states = ebc.table_weights(), ebc.optimizer_state_dict()
    with torch.no_grad():
        for name, w in subset.table_weights().items():
            w.copy_(weights[name])
        subset.load_optimizer_state_dict(
            {k: v for k, v in states.items() if k in subset.optimizer_state_dict()}
        )
    return subset


def build_replica(
    ebc: EmbeddingBagCollection, tables: Sequence[TableConfig]
) -> EmbeddingBagCollection | None:
    """Full replicas of the data-parallel ``tables`` (None without any); their kernels
    take ids already checked (``IdPolicy.ERROR``)."""
    if not tables:
        return None
    return copy_tables(ebc, tables, id_policy=IdPolicy.ERROR, materialize=True)


def build_local(
    ebc: EmbeddingBagCollection,
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    slots: Sequence[Slot],
    rank: int,
) -> Local | None:
    """This rank's shards of the model-parallel ``tables`` as one collection (None when it
    stores none), filled from ``ebc`` or from the tables' init; a cached collection
    when some of them run cached (module doc)."""
    cached = cached_shard_tables(ebc, tables, plan)
    mine = {s.table: s for s in slots}
    shard_tables = []
    for table in tables:
        if table.name not in mine:
            continue
        slot = mine[table.name]
        if ebc.backend is Backend.FBGEMM and slot.width % 4:
            raise ValueError(
                f"table {table.name!r}: its shard on rank {rank} has {slot.width} columns, "
                "but FBGEMM kernels need a multiple of 4; split its columns into fewer "
                "shards or set embedding.backend = 'torch'"
            )
        strategy = strategy_for(plan.tables[table.name].sharding)
        shard_tables.append(
            TableConfig(
                table.name,
                slot.rows[1] - slot.rows[0],
                slot.width,
                table.feature_names,
                strategy.shard_pooling(table.pooling, slot.partial),
                table.init,
                table.scale,
            )
        )
    if not shard_tables:
        return None
    if cached:
        return _cached_local(ebc, tables, shard_tables, cached, plan, rank)
    local = EmbeddingBagCollection(
        shard_tables,
        ebc.optimizer,
        backend=ebc.backend,
        device=ebc.device,
        id_policy=IdPolicy.ERROR,
        seed=ebc.seed,
        materialize=False,
    ).materialize(init=False)
    if not ebc.is_materialized:
        by_name = {t.name: t for t in tables}
        with torch.no_grad():
            for view in shard_views(local, plan, rank):
                table = by_name[view.table]
                fill_table_block(view.weight, table, ebc.seed, view.shard.rows, view.shard.cols)
                for s in view.state.values():
                    s.zero_()
        return local
    weights, states = ebc.table_weights(), ebc.optimizer_state_dict()
    with torch.no_grad():
        for view in shard_views(local, plan, rank):
            (r0, r1), (c0, c1) = view.shard.rows, view.shard.cols
            view.weight.copy_(weights[view.table][r0:r1, c0:c1])
            for name, s in view.state.items():
                full = states[table_key("", view.table, name)]
                if full.dim() == 2:
                    full = full[r0:r1, c0:c1]
                elif full.dim() == 1:
                    full = full[r0:r1]
                s.copy_(full)  # a scalar, the kernels' step, as it is
    return local


def _cached_local(
    ebc: EmbeddingBagCollection,
    tables: Sequence[TableConfig],
    shard_tables: Sequence[TableConfig],
    cached: set[str],
    plan: ShardingPlan,
    rank: int,
) -> CachedEmbeddingBagCollection:
    """This rank's shards with the ``cached`` tables' shards in backing stores; every
    shard initialised as the block of its table (``ebc`` holds no tables)."""
    assert ebc.tiers is not None and not ebc.is_materialized  # distributed runs' build
    by_name = {t.name: t for t in tables}
    blocks, shard_tiers = {}, {}
    for table in shard_tables:
        shards = plan.tables[table.name].shards
        k, shard = next((k, s) for k, s in enumerate(shards) if s.rank == rank)
        blocks[table.name] = TableBlock(
            by_name[table.name], shard.rows, shard.cols, f"{table.name}.shard{k}"
        )
        if table.name in cached:  # cached as its table is, whatever the shard's size
            shard_tiers[table.name] = replace(ebc.tiers[table.name].tier, cache_min_rows=0)
    return CachedEmbeddingBagCollection(
        shard_tables,
        ebc.optimizer,
        tiers=shard_tiers,
        backend=ebc.backend,
        device=ebc.device,
        id_policy=IdPolicy.ERROR,
        seed=ebc.seed,
        blocks=blocks,
    )


def shard_views(local: Local | None, plan: ShardingPlan, rank: int) -> Iterator[ShardView]:
    """The shards of ``local`` (this rank's shard collection) as ``ShardView``s; a cached
    collection's are its stores' rows (flushed first). Kv tables have no dense rows: they
    are left out (their stores travel whole, ``CachedEmbeddingBagCollection.save_stores``)."""
    if local is None:
        return
    states = local.optimizer_state_dict()
    for name, weight in local.dense_table_weights().items():
        shard = next(s for s in plan.tables[name].shards if s.rank == rank)
        yield ShardView(name, shard, weight, table_states(states, name))


def kernel_steps(*modules: Local | None) -> list[torch.Tensor]:
    """The kernels' step tensors (``state_shapes`` ``()``: one per table, the same within a
    kernel) of ``modules``, kv tables' included."""
    out = []
    for module in modules:
        if module is None:
            continue
        for key, value in module.optimizer_state_dict().items():
            if key.endswith(".step") and value.dim() == 0:
                out.append(value)
    return out


def replica_views(replica: EmbeddingBagCollection | None, rank: int) -> Iterator[ShardView]:
    """Data-parallel replicas as full-table ``ShardView``s."""
    if replica is None:
        return
    states = replica.optimizer_state_dict()
    for table in replica.tables:
        yield ShardView(
            table.name,
            Shard(rank, (0, table.num_embeddings), (0, table.embedding_dim)),
            replica.table_weights()[table.name],
            table_states(states, table.name),
        )
