"""Table-column-wise: a table owned by one host, its columns split across the host's ranks.

::

    host 0: rank 0 [ all rows x cols 0..D/2 )  rank 1 [ all rows x cols D/2..D )

    split, input_dist, lookup, output_dist   as column-wise (``column_wise.py``):
                  every id of the table goes to each column shard on the owning
                  host; the samples' owners place the column blocks side by side
    invalid       column-wise's rules, and shards on more than one host

Row-wise Adagrad stays exact as under column-wise: the shards combine the row
statistic (``column_wise.row_statistic``).
"""

from __future__ import annotations

from towerrec.modules.tables import TableConfig
from towerrec.sharding.base import one_host_problems
from towerrec.sharding.column_wise import ColumnWise
from towerrec.sharding.types import ShardingType, TablePlan

__all__ = ["TABLE_COLUMN_WISE", "TableColumnWise"]


class TableColumnWise(ColumnWise):
    kind = ShardingType.TABLE_COLUMN_WISE
    one_host = True

    def layout_problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        out = super().layout_problems(table, plan, world_size, ranks_per_host)
        return out + one_host_problems(table.name, plan, world_size, ranks_per_host)


TABLE_COLUMN_WISE = TableColumnWise()
