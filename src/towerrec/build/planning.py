"""From a run's config and data source to a sharding plan (``plan.strategy``).

``auto`` measures the source's table statistics, builds the topology from the
``plan`` section and the world size, and runs the configured planner; ``file``
loads a plan JSON and checks it against the tables; ``none`` returns None.
Planning is deterministic, so every rank that calls this gets the same plan,
or the same ``PlanningError``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from towerrec.config import Config
from towerrec.optim.sparse import EmbeddingOptimizer
from towerrec.planner.cost import CostConstants, CostModel
from towerrec.planner.placement import PlanningError, TableConstraint
from towerrec.planner.search import PlanRequest, PlanResult, get_planner
from towerrec.planner.stats import TableStats, stats_from_source
from towerrec.planner.topology import topology_preset
from towerrec.planner.tower_layout import TowerLayout, choose_tower_layout
from towerrec.sharding import ShardingPlan, ShardingType

if TYPE_CHECKING:
    from towerrec.modules.tables import TableConfig

__all__ = [
    "build_cost_model",
    "build_plan",
    "kv_table_slots",
    "kv_tables",
    "plan_source",
    "plan_tower_layouts",
    "refuse_kv_tables",
]

GiB = float(1 << 30)

log = logging.getLogger("towerrec")


def build_cost_model(config: Config, world_size: int) -> CostModel:
    plan = config.plan
    if world_size % plan.hosts:
        raise ValueError(
            f"world size {world_size} is not a multiple of plan.hosts = {plan.hosts}; set "
            "plan.hosts to a divisor of the number of ranks"
        )
    local = plan.ranks_per_host or world_size // plan.hosts
    if local * plan.hosts != world_size:
        raise ValueError(
            f"plan.hosts x plan.ranks_per_host = {plan.hosts} x {local} is not the world size "
            f"{world_size}; set plan.ranks_per_host = 0 to derive it"
        )
    overrides = {}
    if plan.device_memory_gib:
        overrides["device_memory"] = plan.device_memory_gib * GiB
    topology = topology_preset(plan.topology, plan.hosts, local, **overrides)
    constants = CostConstants.load(plan.calibration) if plan.calibration else CostConstants()
    # The optimizer state each row carries (fp32), as the configured optimizer keeps it.
    shapes = EmbeddingOptimizer(config.embedding.optimizer).state_shapes(1, 1).values()
    constants = replace(
        constants,
        optimizer_bytes_per_row=4 * sum(1 for shape in shapes if shape == (1,)),
        optimizer_bytes_per_value=4 * sum(1 for shape in shapes if shape == (1, 1)),
    )
    return CostModel(topology, constants, config.train.batch_size)


def kv_tables(config: Config, tables: Sequence[tuple[str, int]]) -> list[str]:
    """The names of ``tables`` (``(name, rows)``) that run as kv tables (rows keyed by
    64-bit id in an LMDB store, ``embedding.backing = 'kv'``)."""
    tiers = config.embedding.tiers()
    return [name for name, rows in tables if tiers.place(name, rows, warn=False).is_kv]


def kv_table_slots(config: Config, tables: Sequence[tuple[str, int]]) -> dict[str, int]:
    """``{name: cache slots}`` of the kv tables among ``tables`` (``kv_tables``)."""
    tiers = config.embedding.tiers()
    placements = {name: tiers.place(name, rows, warn=False) for name, rows in tables}
    return {name: p.cache_rows for name, p in placements.items() if p.is_kv}


def _as_cache(stats: TableStats, slots: int) -> TableStats:
    """``stats`` of a kv table as the planner sees it: a table of its cache's ``slots``."""
    return replace(
        stats, num_embeddings=slots, distinct_per_batch=min(stats.distinct_per_batch, slots)
    )


def refuse_kv_tables(config: Config, tables: Sequence[tuple[str, int]], what: str) -> None:
    """A clear error if any of ``tables`` is a kv table, which ``what`` cannot handle."""
    names = kv_tables(config, tables)
    if names:
        raise ValueError(
            f"{what} does not handle kv tables (embedding.backing = 'kv': rows keyed by id, "
            f"num_embeddings only an id space), and {', '.join(map(repr, names[:5]))} "
            f"{'is one' if len(names) == 1 else 'are'}; train kv tables in one process or "
            "sharded table-wise (a plain model), or set embedding.backing = 'ssd' with a "
            "real row count"
        )


def plan_source(
    config: Config, source, world_size: int, stats: list[TableStats] | None = None
) -> PlanResult:
    """Plan the tables of ``source`` (one per sparse feature) with ``config.plan``."""
    if stats is None:
        stats = stats_from_source(
            source,
            config.model.embedding_dim,
            batch_size=config.plan.stats_batch_size,
            num_batches=config.plan.stats_batches,
        )
    # A kv table is placed whole (table-wise) and costs what its cache holds: the
    # planner sees its cache's slots as its rows; the plan gets its real rows back.
    original = list(stats)
    kv = kv_table_slots(config, [(s.name, s.num_embeddings) for s in original])
    constraints = {name: TableConstraint((ShardingType.TABLE_WISE,)) for name in kv}
    stats = [_as_cache(s, kv[s.name]) if s.name in kv else s for s in original]
    request = PlanRequest(
        stats,
        build_cost_model(config, world_size),
        constraints,
        weights=config.plan.weights or None,
        kernel=config.embedding.backend.value,
    )
    try:
        result = get_planner(config.plan.planner).plan(request)
    except PlanningError as e:
        full = next((n for n in kv if f"table {n!r} needs" in str(e)), None)
        if full is None:
            raise
        raise PlanningError(
            f"kv table {full!r} is placed whole on one device (table-wise only), but its "
            f"cache of {kv[full]:,} slots does not fit one ({str(e).split(' and ', 1)[0]}); lower embedding.cache_slots "
            f"(or [embedding.tables.{full}] cache_slots) or use devices with more memory "
            "(plan.device_memory_gib)"
        ) from None
    if not kv:
        return result
    real = {s.name: s.num_embeddings for s in original}
    tables = dict(result.plan.tables)
    for name in kv:
        placed = tables[name]
        if placed.sharding is not ShardingType.TABLE_WISE:  # the constraint forbids it
            raise PlanningError(
                f"the planner placed kv table {name!r} {placed.sharding.value!r}; kv tables "
                "shard 'table_wise' only: use another plan.planner"
            )
        tables[name] = replace(
            placed,
            shards=tuple(replace(shard, rows=(0, real[name])) for shard in placed.shards),
        )
    return replace(result, plan=replace(result.plan, tables=tables))


def load_plan_file(config: Config, world_size: int) -> ShardingPlan:
    """``plan.path``'s plan, refused unless it is for ``world_size`` ranks (the launcher
    calls it too, so a wrong file stops the run before any worker starts)."""
    plan = ShardingPlan.load(config.plan.path)
    if plan.world_size != world_size:
        raise ValueError(
            f"plan {config.plan.path!r} is for {plan.world_size} ranks but the run has "
            f"{world_size}; write a new one with `towerrec plan`"
        )
    return plan


def build_plan(config: Config, source, world_size: int) -> ShardingPlan | None:
    """The plan a run of ``world_size`` ranks uses, per ``config.plan.strategy``."""
    strategy = config.plan.strategy
    if strategy == "none":
        return None
    if strategy == "file":
        from towerrec.modules.tables import TableConfig

        plan = load_plan_file(config, world_size)
        plan.validate(
            [
                TableConfig(f.name, f.num_embeddings, config.model.embedding_dim)
                for f in source.schema.sparse
            ]
        )
        return plan
    return plan_source(config, source, world_size).plan


def _table_stats(table: TableConfig, features: dict[str, TableStats]) -> TableStats:
    """A table's statistics from those of the features it serves (their lookups add up)."""
    parts = [features[f] for f in table.feature_names]
    total = parts[0]
    for more in parts[1:]:
        total = replace(
            total,
            pooling_factor=total.pooling_factor + more.pooling_factor,
            pooling_p50=total.pooling_p50 + more.pooling_p50,
            pooling_p99=total.pooling_p99 + more.pooling_p99,
            pooling_max=total.pooling_max + more.pooling_max,
            distinct_per_batch=total.distinct_per_batch + more.distinct_per_batch,
        )
    distinct = min(total.distinct_per_batch, table.num_embeddings)
    return replace(
        total,
        name=table.name,
        num_embeddings=table.num_embeddings,
        embedding_dim=table.embedding_dim,
        distinct_per_batch=distinct,
        feature_names=tuple(table.feature_names),
    )


def plan_tower_layouts(
    config: Config, source, towers: Sequence[Sequence[TableConfig]], ranks_per_host: int
) -> list[TowerLayout]:
    """The in-host layout of each tower's tables (``planner/tower_layout.py``): the
    source's feature statistics, the cost model of ``config.plan`` on one host of
    ``ranks_per_host`` ranks, each rank looking up its peer batch (the global batch
    over ``ranks_per_host``). Deterministic: every rank gets the same layouts."""
    features = {
        s.name: s
        for s in stats_from_source(
            source,
            config.model.embedding_dim,
            batch_size=config.plan.stats_batch_size,
            num_batches=config.plan.stats_batches,
        )
    }
    one_host = replace(config, plan=replace(config.plan, hosts=1, ranks_per_host=0))
    model = build_cost_model(one_host, ranks_per_host)
    model = model.with_batch_size(max(config.train.batch_size // ranks_per_host, 1))
    return [
        choose_tower_layout([_table_stats(t, features) for t in tables], model) for tables in towers
    ]
