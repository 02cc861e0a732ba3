"""The pieces of a plan: the sharding types, a shard, the plan of one table.

A shard is a (row range x column range) block of a table on one rank::

    table [N rows x D cols]        Shard(rank, rows=(r0, r1), cols=(c0, c1))
    ┌──────────────┐
    │   r0..r1 x   │  on rank `rank`
    │   c0..c1     │
    └──────────────┘
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Shard", "ShardingType", "TablePlan", "even_splits"]


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

    @property
    def row_ranges(self) -> list[tuple[int, int]]:
        """The distinct row ranges of the shards, ascending (one unless rows are split)."""
        return sorted({s.rows for s in self.shards})

    @property
    def column_ranges(self) -> list[tuple[int, int]]:
        """The distinct column ranges of the shards, ascending (one unless columns are split)."""
        return sorted({s.cols for s in self.shards})


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
