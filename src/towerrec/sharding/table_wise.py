"""Table-wise: the whole table on one rank.

::

    rank 0 [ table A ]   rank 1 [ table B ]
    ids of A from every rank ──► rank 0 ──► pooled A ──► back to each sample's owner

    split         one shard: all rows x all columns, on the one rank given
    input_dist    every id of the table's features goes to that rank, as it is
    output_dist   the pooled vectors are the table's: placed at the feature's columns
    invalid       more than one shard, or a shard that is not the whole table
"""

from __future__ import annotations

from collections.abc import Sequence

from towerrec.modules.tables import TableConfig
from towerrec.sharding.base import (
    ShardingStrategy,
    duplicate_rank_problems,
    span_problems,
    tiling_problems,
)
from towerrec.sharding.types import Shard, ShardingType, TablePlan

__all__ = ["TABLE_WISE", "TableWise"]


class TableWise(ShardingStrategy):
    kind = ShardingType.TABLE_WISE

    def split(self, table: TableConfig, ranks: Sequence[int]) -> tuple[Shard, ...]:
        if len(ranks) != 1:
            raise ValueError(
                f"table {table.name!r}: table_wise places the table on exactly one rank"
            )
        return (Shard(ranks[0], (0, table.num_embeddings), (0, table.embedding_dim)),)

    def layout_problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        out = duplicate_rank_problems(table.name, plan)
        if len(plan.shards) != 1:
            out.append(
                f"table {table.name!r}: table_wise has exactly one shard, got {len(plan.shards)}"
            )
        out += span_problems(table, plan, by_rows=True)
        return out + tiling_problems(table, plan, by_rows=True)


TABLE_WISE = TableWise()
