"""Table-column-wise: a table owned by one host, its columns split across the host's ranks.

::

    host 0: rank 0 [ all rows x cols 0..D/2 )  rank 1 [ all rows x cols D/2..D )
    every id of the table goes to each column shard on the owning host; the
    samples' owners place the column blocks side by side

Row-wise Adagrad stays exact as under column-wise: the shards combine the row
statistic (``column_wise.ColumnRowwiseSync``).
"""

from towerrec.distributed.sharding.base import ShardingStrategy
from towerrec.planner.plan import ShardingType

TABLE_COLUMN_WISE = ShardingStrategy(
    ShardingType.TABLE_COLUMN_WISE, splits_rows=False, splits_cols=True, one_host=True
)
