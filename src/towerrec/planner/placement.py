"""Shard items and device loads: the pieces every placement algorithm moves around.

A table becomes one or more *items* (shards with a cost, a memory footprint and
a kernel width); shards of one split table form a *group* and must sit on
distinct ranks. ``Loads`` keeps each device's cost the way a device pays it:
the sum of its shards' costs plus one kernel overhead per distinct width and a
per-shard overhead (planner.cost).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from towerrec.planner.cost import CostModel
from towerrec.planner.stats import TableStats
from towerrec.sharding import ShardingType, column_wise, row_wise

__all__ = ["DEFAULT_TYPES", "Item", "Loads", "PlanningError", "TableConstraint", "build_items"]

GiB = float(1 << 30)
DEFAULT_TYPES = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE)


class PlanningError(ValueError):
    """The task cannot be planned (not enough memory, no allowed split); says why and how to fix."""


@dataclass(frozen=True)
class TableConstraint:
    """What a planner may do with one table: allowed sharding types, and an optional
    rank to pin a table-wise table to."""

    sharding_types: tuple[ShardingType, ...] = DEFAULT_TYPES
    rank: int | None = None

    def __post_init__(self) -> None:
        types = tuple(ShardingType(t) for t in self.sharding_types)
        if not types:
            raise ValueError("a table constraint needs at least one allowed sharding type")
        object.__setattr__(self, "sharding_types", types)


@dataclass
class Item:
    table: str
    sharding: ShardingType
    rows: tuple[int, int]
    cols: tuple[int, int]
    cost: float
    memory: float
    width: int  # index of the kernel width (shard columns) in Loads
    group: int
    fixed_rank: int | None = None
    stats: TableStats | None = field(default=None, repr=False)


def _gib(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB at most)."""
    for unit, size in (("GiB", GiB), ("MiB", GiB / 1024), ("KiB", GiB / 1024**2)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _table_items(
    s: TableStats,
    model: CostModel,
    constraint: TableConstraint,
    split: tuple[ShardingType, int] | None,
    group: int,
) -> list[tuple[ShardingType, tuple[int, int], tuple[int, int], int | None]]:
    """(sharding, rows, cols, fixed rank) of each shard of table ``s``."""
    world = model.topology.world_size
    capacity = model.topology.device_memory
    allowed = constraint.sharding_types
    full_rows, full_cols = (0, s.num_embeddings), (0, s.embedding_dim)
    memory = model.shard_memory(s, s.num_embeddings, s.embedding_dim)

    def row_split() -> list[tuple[ShardingType, tuple[int, int], tuple[int, int], int | None]]:
        parts = row_wise.planner_parts(world, s.num_embeddings)
        return [
            (ShardingType.ROW_WISE, span, full_cols, r)
            for r, span in enumerate(row_wise.row_spans(s.num_embeddings, parts))
        ]

    def column_split(
        parts: int,
    ) -> list[tuple[ShardingType, tuple[int, int], tuple[int, int], int | None]]:
        return [
            (ShardingType.COLUMN_WISE, full_rows, span, None)
            for span in column_wise.column_spans(s.embedding_dim, parts)
        ]

    if split is not None:
        kind, parts = split
        if kind is ShardingType.ROW_WISE:
            return row_split()
        return column_split(parts)
    if ShardingType.DATA_PARALLEL in allowed and len(allowed) == 1:
        return [(ShardingType.DATA_PARALLEL, full_rows, full_cols, r) for r in range(world)]
    if memory <= capacity and ShardingType.TABLE_WISE in allowed:
        return [(ShardingType.TABLE_WISE, full_rows, full_cols, constraint.rank)]
    # Too large for one device (or table-wise not allowed): split it.
    if ShardingType.ROW_WISE in allowed:
        ranks = row_wise.planner_parts(world, s.num_embeddings)
        need = model.shard_memory(s, math.ceil(s.num_embeddings / ranks), s.embedding_dim)
        if need <= capacity:
            return row_split()
    if ShardingType.COLUMN_WISE in allowed:
        most = min(world, s.embedding_dim)
        for parts in range(2, most + 1):
            widest = math.ceil(s.embedding_dim / parts)
            if model.shard_memory(s, s.num_embeddings, widest) <= capacity:
                return column_split(parts)
    splits = [t.value for t in allowed if t in (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)]
    if splits:
        how = (
            f"an even {' or '.join(splits)} split over the {world} ranks still leaves a shard "
            "too large; add ranks or use devices with more memory"
        )
    else:
        how = (
            f"its allowed sharding types {[t.value for t in allowed]} cannot split it; allow "
            "row_wise or column_wise, add ranks, or use devices with more memory"
        )
    raise PlanningError(
        f"table {s.name!r} needs {_gib(memory)} but a device holds {_gib(capacity)} "
        f"(short by {_gib(memory - capacity)}) and {how}"
    )


def build_items(
    stats: Sequence[TableStats],
    model: CostModel,
    constraints: Mapping[str, TableConstraint] | None = None,
    splits: Mapping[str, tuple[ShardingType, int]] | None = None,
    cache: dict[Any, Any] | None = None,
) -> tuple[list[Item], list[int]]:
    """The items of every table, and the distinct kernel widths (index = ``Item.width``).

    ``cache`` (a dict the caller keeps) remembers shard costs across calls for
    the same model. Raises ``PlanningError`` if a table cannot fit anywhere or the tables need
    more memory than all devices hold.
    """
    constraints = constraints or {}
    splits = splits or {}
    unknown = sorted(set(constraints) - {s.name for s in stats})
    if unknown:
        raise ValueError(f"constraints name unknown tables {unknown}")
    world = model.topology.world_size
    for name, c in constraints.items():
        if c.rank is not None and not 0 <= c.rank < world:
            raise PlanningError(
                f"table {name!r} is pinned to rank {c.rank}, outside 0..{world - 1}"
            )
    cache = {} if cache is None else cache
    per_table = []
    for group, s in enumerate(stats):
        constraint = constraints.get(s.name, TableConstraint())
        split = splits.get(s.name)
        key = (s.name, split, constraint)
        if key not in cache:
            shards = []
            for kind, rows, cols, rank in _table_items(s, model, constraint, split, group):
                num_rows, num_cols = rows[1] - rows[0], cols[1] - cols[0]
                cost_key = (s.name, kind, num_rows, num_cols)
                if cost_key not in cache:
                    cache[cost_key] = (
                        model.shard_cost(s, kind, num_rows, num_cols).total,
                        model.shard_memory(s, num_rows, num_cols),
                    )
                shards.append((kind, rows, cols, rank, *cache[cost_key]))
            cache[key] = shards
        per_table.append((group, s, cache[key]))
    widths = sorted({c[1] - c[0] for _, _, shards in per_table for _, _, c, *_ in shards})
    index = {w: i for i, w in enumerate(widths)}
    items = [
        Item(s.name, kind, rows, cols, cost, memory, index[cols[1] - cols[0]], group, rank, s)
        for group, s, shards in per_table
        for kind, rows, cols, rank, cost, memory in shards
    ]
    need = sum(i.memory for i in items)
    have = world * model.topology.device_memory
    if need > have:
        raise PlanningError(
            f"the tables need {_gib(need)} in total but the {world} devices hold {_gib(have)} "
            f"(short by {_gib(need - have)}); add ranks or use devices with more memory"
        )
    return items, widths


class Loads:
    """Per-device cost, memory and shard membership while a placement is built."""

    def __init__(self, model: CostModel, num_widths: int) -> None:
        world = model.topology.world_size
        c = model.constants
        self.capacity = model.topology.device_memory
        self.kernel_overhead = c.kernel_overhead_s
        self.shard_overhead = c.table_overhead_s
        self.cost = np.zeros(world)
        self.memory = np.zeros(world)
        self.widths = np.zeros((world, max(num_widths, 1)), dtype=np.int64)
        self.count = np.zeros(world, dtype=np.int64)
        self.on: list[list[int]] = [[] for _ in range(world)]
        self.groups: dict[int, set[int]] = {}

    def totals(self) -> np.ndarray:
        return cast(
            np.ndarray,
            self.cost
            + self.kernel_overhead * (self.widths > 0).sum(axis=1)
            + self.shard_overhead * self.count,
        )

    def totals_with(self, item: Item) -> np.ndarray:
        """Every device's cost if ``item`` were added to it."""
        return cast(
            np.ndarray,
            self.totals()
            + item.cost
            + self.shard_overhead
            + self.kernel_overhead * (self.widths[:, item.width] == 0),
        )

    def feasible(self, item: Item) -> np.ndarray:
        ok = self.memory + item.memory <= self.capacity * (1 + 1e-12)
        for rank in self.groups.get(item.group, ()):
            ok[rank] = False
        return ok

    def total_at(self, rank: int, remove: Sequence[Item] = (), add: Sequence[Item] = ()) -> float:
        widths = self.widths[rank].copy()
        cost, count = self.cost[rank], self.count[rank]
        for it in remove:
            widths[it.width] -= 1
            cost -= it.cost
            count -= 1
        for it in add:
            widths[it.width] += 1
            cost += it.cost
            count += 1
        return float(cost + self.kernel_overhead * (widths > 0).sum() + self.shard_overhead * count)

    def add(self, rank: int, index: int, item: Item) -> None:
        self.cost[rank] += item.cost
        self.memory[rank] += item.memory
        self.widths[rank, item.width] += 1
        self.count[rank] += 1
        self.on[rank].append(index)
        self.groups.setdefault(item.group, set()).add(rank)

    def add_many(self, ranks: np.ndarray, indices: Sequence[int], items: Sequence[Item]) -> None:
        """``add`` for shards on distinct ``ranks`` at once."""
        assert len(set(ranks.tolist())) == len(ranks), "one shard per rank"
        self.cost[ranks] += [it.cost for it in items]
        self.memory[ranks] += [it.memory for it in items]
        self.widths[ranks, [it.width for it in items]] += 1
        self.count[ranks] += 1
        for rank, index, item in zip(ranks.tolist(), indices, items):
            self.on[rank].append(index)
            self.groups.setdefault(item.group, set()).add(rank)

    def remove(self, rank: int, index: int, item: Item) -> None:
        self.cost[rank] -= item.cost
        self.memory[rank] -= item.memory
        self.widths[rank, item.width] -= 1
        self.count[rank] -= 1
        self.on[rank].remove(index)
        self.groups[item.group].discard(rank)
