"""One strategy per sharding type (one file each)."""

from towerrec.distributed.sharding.base import ShardingStrategy
from towerrec.distributed.sharding.column_wise import COLUMN_WISE
from towerrec.distributed.sharding.data_parallel import DATA_PARALLEL
from towerrec.distributed.sharding.row_wise import ROW_WISE
from towerrec.distributed.sharding.table_column_wise import TABLE_COLUMN_WISE
from towerrec.distributed.sharding.table_row_wise import TABLE_ROW_WISE
from towerrec.distributed.sharding.table_wise import TABLE_WISE
from towerrec.planner.plan import ShardingType

__all__ = ["STRATEGIES", "ShardingStrategy", "strategy_for"]

STRATEGIES: dict[ShardingType, ShardingStrategy] = {
    s.kind: s
    for s in (TABLE_WISE, ROW_WISE, COLUMN_WISE, TABLE_ROW_WISE, TABLE_COLUMN_WISE, DATA_PARALLEL)
}


def strategy_for(kind: ShardingType) -> ShardingStrategy:
    return STRATEGIES[kind]
