"""Table-row-wise: a table owned by one host, its rows split across the host's ranks.

::

    host 0: rank 0 [ rows 0..N/2 )  rank 1 [ rows N/2..N )     host 1: other tables

    split         row-wise (``row_wise.py``) over the ranks of one host
    input_dist    ids cross hosts once to the owning host; inside it, each id goes
                  to the local rank owning its row (row-wise's ``bucketize``)
    lookup        partial sums, as row-wise
    output_dist   when the rows span every rank of the host (and there are several
                  hosts), ``hierarchical``: local rank l adds the partials of the
                  samples of every host's rank l from its host peers
                  (``add_host_partials``), and one message per sample crosses hosts;
                  otherwise the owners add the partials, as row-wise
    invalid       row-wise's rules, and shards on more than one host
"""

from __future__ import annotations

import torch

from towerrec.modules.tables import TableConfig
from towerrec.sharding.base import one_host_problems
from towerrec.sharding.row_wise import RowWise
from towerrec.sharding.types import ShardingType, TablePlan

__all__ = ["TABLE_ROW_WISE", "TableRowWise", "add_host_partials"]


def add_host_partials(
    gathered: torch.Tensor, ranks_per_host: int, rows: int, width: int
) -> torch.Tensor:
    """``[ranks_per_host * rows * width]`` partial sums gathered from the host's ranks
    (rank by rank) -> their sum ``[rows, width]``."""
    return gathered.view(ranks_per_host, rows, width).sum(dim=0)


class TableRowWise(RowWise):
    kind = ShardingType.TABLE_ROW_WISE
    one_host = True

    def layout_problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        out = super().layout_problems(table, plan, world_size, ranks_per_host)
        return out + one_host_problems(table.name, plan, world_size, ranks_per_host)

    def hierarchical(self, plan: TablePlan, hosts: int, ranks_per_host: int) -> bool:
        if hosts == 1 or ranks_per_host == 1:
            return False
        host = plan.shards[0].rank // ranks_per_host
        return sorted(plan.ranks) == list(range(host * ranks_per_host, (host + 1) * ranks_per_host))


TABLE_ROW_WISE = TableRowWise()
