"""The sharding plan: where every piece of every embedding table lives.

A plan is pure data (JSON in, JSON out): planners produce it, the sharded
embedding collection consumes it. For a world of ``world_size`` ranks on
``hosts`` hosts (ranks ``h*L .. h*L+L-1`` on host h, L = world_size / hosts)::

    table_wise          one shard = the whole table, on one rank
    row_wise            row ranges [r0, r1) x all columns, one per rank, over all ranks
    column_wise         all rows x column ranges [c0, c1), one per rank
    table_row_wise      row ranges over the ranks of ONE host (reduce inside the host)
    table_column_wise   column ranges over the ranks of ONE host
    data_parallel       a full replica on every rank (gradients all-reduced)

Shards of one table must tile it exactly (no gap, no overlap), except
data_parallel, whose shards are identical full replicas on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from towerrec.modules.tables import TableConfig
from towerrec.utils import parse_enum

__all__ = [
    "Shard",
    "ShardingPlan",
    "ShardingType",
    "TablePlan",
    "even_splits",
    "plan_table",
]


class ShardingType(StrEnum):
    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"


@dataclass(frozen=True)
class Shard:
    """Rows ``[rows[0], rows[1])`` x columns ``[cols[0], cols[1])`` of a table, on ``rank``."""

    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def num_cols(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True)
class TablePlan:
    table: str
    sharding: ShardingType
    shards: tuple[Shard, ...]

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.shards]


def even_splits(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, total)``, sizes differing by at most one."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def plan_table(table: TableConfig, sharding: ShardingType | str, ranks: Sequence[int]) -> TablePlan:
    """The usual geometry for ``sharding`` over ``ranks`` (even row or column splits)."""
    sharding = parse_enum(ShardingType, sharding, "sharding type")
    rows, cols = (0, table.num_embeddings), (0, table.embedding_dim)
    ranks = list(ranks)
    if not ranks:
        raise ValueError(f"table {table.name!r}: a plan needs at least one rank")
    if sharding is ShardingType.TABLE_WISE:
        if len(ranks) != 1:
            raise ValueError(
                f"table {table.name!r}: table_wise places the table on exactly one rank"
            )
        shards = [Shard(ranks[0], rows, cols)]
    elif sharding is ShardingType.DATA_PARALLEL:
        shards = [Shard(r, rows, cols) for r in ranks]
    elif sharding in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        shards = [
            Shard(r, span, cols)
            for r, span in zip(ranks, even_splits(table.num_embeddings, len(ranks)))
        ]
    else:
        shards = [
            Shard(r, rows, span)
            for r, span in zip(ranks, even_splits(table.embedding_dim, len(ranks)))
        ]
    return TablePlan(table.name, sharding, tuple(shards))


@dataclass(frozen=True)
class ShardingPlan:
    world_size: int
    hosts: int = 1
    tables: dict[str, TablePlan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.hosts < 1 or self.world_size % self.hosts:
            raise ValueError(
                f"world_size {self.world_size} must be a positive multiple of hosts {self.hosts}"
            )

    @property
    def ranks_per_host(self) -> int:
        return self.world_size // self.hosts

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def shards_on(self, rank: int) -> list[tuple[str, Shard]]:
        """``(table, shard)`` pairs stored on ``rank``, in plan order."""
        return [(name, s) for name, tp in self.tables.items() for s in tp.shards if s.rank == rank]

    # ------------------------------------------------------------ checking
    def validate(self, tables: Iterable[TableConfig]) -> None:
        """Raise ``ValueError`` naming every problem of this plan for ``tables``."""
        tables = {t.name: t for t in tables}
        problems = []
        missing = sorted(set(tables) - set(self.tables))
        extra = sorted(set(self.tables) - set(tables))
        if missing:
            problems.append(f"no placement for tables {missing}")
        if extra:
            problems.append(f"placements for unknown tables {extra}")
        for name, tp in self.tables.items():
            if name in tables:
                problems.extend(self._table_problems(tables[name], tp))
        if problems:
            raise ValueError("invalid sharding plan: " + "; ".join(problems))

    def _table_problems(self, table: TableConfig, tp: TablePlan) -> list[str]:
        name, kind = table.name, tp.sharding
        if not tp.shards:
            return [f"table {name!r} has no shards"]
        out = []
        for s in tp.shards:
            if not 0 <= s.rank < self.world_size:
                out.append(f"table {name!r}: rank {s.rank} outside world of {self.world_size}")
            if not (
                0 <= s.rows[0] < s.rows[1] <= table.num_embeddings
                and 0 <= s.cols[0] < s.cols[1] <= table.embedding_dim
            ):
                out.append(
                    f"table {name!r}: shard {s.rows}x{s.cols} is empty or outside "
                    f"the table's {table.num_embeddings}x{table.embedding_dim}"
                )
        if out:
            return out
        full_rows, full_cols = (0, table.num_embeddings), (0, table.embedding_dim)
        ranks = tp.ranks
        if kind is ShardingType.DATA_PARALLEL:
            if sorted(ranks) != list(range(self.world_size)) or any(
                s.rows != full_rows or s.cols != full_cols for s in tp.shards
            ):
                out.append(
                    f"table {name!r}: data_parallel needs a full replica on each of the "
                    f"{self.world_size} ranks exactly once"
                )
            return out
        if len(set(ranks)) != len(ranks):
            out.append(f"table {name!r}: a rank holds two shards of one {kind.value} table")
        if kind is ShardingType.TABLE_WISE and len(tp.shards) != 1:
            out.append(f"table {name!r}: table_wise has exactly one shard, got {len(tp.shards)}")
        by_rows = kind in (
            ShardingType.ROW_WISE,
            ShardingType.TABLE_ROW_WISE,
            ShardingType.TABLE_WISE,
        )
        if by_rows and any(s.cols != full_cols for s in tp.shards):
            out.append(f"table {name!r}: {kind.value} shards must span all columns")
        if not by_rows and any(s.rows != full_rows for s in tp.shards):
            out.append(f"table {name!r}: {kind.value} shards must span all rows")
        spans = sorted((s.rows if by_rows else s.cols) for s in tp.shards)
        size = table.num_embeddings if by_rows else table.embedding_dim
        position = 0
        for lo, hi in spans:
            if lo != position:
                out.append(
                    f"table {name!r}: {kind.value} shards leave a gap or overlap at "
                    f"{'row' if by_rows else 'column'} {min(lo, position)}"
                )
                break
            position = hi
        else:
            if position != size:
                out.append(f"table {name!r}: shards end at {position}, the table has {size}")
        if kind in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE):
            hosts = {self.host_of(r) for r in ranks if 0 <= r < self.world_size}
            if len(hosts) != 1:
                out.append(
                    f"table {name!r}: {kind.value} shards must all be on one host, "
                    f"got hosts {sorted(hosts)}"
                )
        return out

    # -------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "hosts": self.hosts,
            "tables": {
                name: {
                    "sharding": tp.sharding.value,
                    "shards": [
                        {"rank": s.rank, "rows": list(s.rows), "cols": list(s.cols)}
                        for s in tp.shards
                    ],
                }
                for name, tp in self.tables.items()
            },
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ShardingPlan:
        try:
            tables = {
                name: TablePlan(
                    name,
                    parse_enum(ShardingType, entry["sharding"], f"sharding type of table {name!r}"),
                    tuple(
                        Shard(int(s["rank"]), tuple(s["rows"]), tuple(s["cols"]))
                        for s in entry["shards"]
                    ),
                )
                for name, entry in data["tables"].items()
            }
            return ShardingPlan(int(data["world_size"]), int(data.get("hosts", 1)), tables)
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"malformed sharding plan: missing or wrong field {e}; expected "
                '{"world_size": N, "hosts": H, "tables": {name: {"sharding": ..., "shards": '
                '[{"rank": r, "rows": [r0, r1], "cols": [c0, c1]}]}}}'
            ) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> ShardingPlan:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"plan file {str(path)!r} does not exist; write one with `towerrec plan`"
            )
        try:
            return ShardingPlan.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"plan file {str(path)!r} is not valid JSON: {e}") from None
