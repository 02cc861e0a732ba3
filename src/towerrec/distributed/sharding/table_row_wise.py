"""Table-row-wise: a table owned by one host, its rows split across the host's ranks.

::

    host 0: rank 0 [ rows 0..N/2 )  rank 1 [ rows N/2..N )     host 1: other tables
    ids cross hosts once to the owning host; inside it, each id goes to the local
    rank owning its row; partial sums return to the samples' owners and are added
"""

from towerrec.distributed.sharding.base import ShardingStrategy
from towerrec.planner.plan import ShardingType

TABLE_ROW_WISE = ShardingStrategy(
    ShardingType.TABLE_ROW_WISE, splits_rows=True, splits_cols=False, one_host=True
)
