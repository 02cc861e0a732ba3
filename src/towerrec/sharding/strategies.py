"""The strategy of every sharding type."""

from __future__ import annotations

from towerrec.sharding.base import ShardingStrategy
from towerrec.sharding.column_wise import COLUMN_WISE
from towerrec.sharding.data_parallel import DATA_PARALLEL
from towerrec.sharding.row_wise import ROW_WISE
from towerrec.sharding.table_column_wise import TABLE_COLUMN_WISE
from towerrec.sharding.table_row_wise import TABLE_ROW_WISE
from towerrec.sharding.table_wise import TABLE_WISE
from towerrec.sharding.types import ShardingType

__all__ = ["STRATEGIES", "TOWER_SHARDINGS", "strategy_for"]

STRATEGIES: dict[ShardingType, ShardingStrategy] = {
    s.kind: s
    for s in (TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE, TABLE_COLUMN_WISE, DATA_PARALLEL)
}

# The types that need no host structure: the tower transform shards a tower's tables
# with one of them inside its host (the host is the whole world there).
TOWER_SHARDINGS = tuple(s.kind for s in STRATEGIES.values() if not s.one_host)


def strategy_for(kind: ShardingType) -> ShardingStrategy:
    return STRATEGIES[kind]
