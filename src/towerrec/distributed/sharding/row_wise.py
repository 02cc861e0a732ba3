"""Row-wise: row ranges of a table over all ranks.

::

    rank 0 [ rows 0..N/2 )   rank 1 [ rows N/2..N )
    each id goes to the rank owning its row (bucketize); every rank pools its
    ids into a partial sum; the owner of a sample adds the partials
    (mean pooling: partial sums, divided by the full bag length at the owner)
"""

from towerrec.distributed.sharding.base import ShardingStrategy
from towerrec.planner.plan import ShardingType

ROW_WISE = ShardingStrategy(
    ShardingType.ROW_WISE, splits_rows=True, splits_cols=False, one_host=False
)
