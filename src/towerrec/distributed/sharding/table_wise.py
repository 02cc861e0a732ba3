"""Table-wise: the whole table on one rank.

::

    rank 0 [ table A ]   rank 1 [ table B ]
    ids of A from every rank ──► rank 0 ──► pooled A ──► back to each sample's owner
"""

from towerrec.distributed.sharding.base import ShardingStrategy
from towerrec.planner.plan import ShardingType

TABLE_WISE = ShardingStrategy(
    ShardingType.TABLE_WISE, splits_rows=False, splits_cols=False, one_host=False
)
