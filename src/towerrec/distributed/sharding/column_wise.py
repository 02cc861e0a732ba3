"""Column-wise: column ranges of a table over ranks.

::

    rank 0 [ all rows x cols 0..D/2 )   rank 1 [ all rows x cols D/2..D )
    every id goes to every column shard; the owner places the pooled column
    blocks side by side.

With ``rowwise_adagrad`` each column shard keeps its own per-row state (the
mean of squared gradients over its columns only), so updates differ from the
unsharded table's (as in TorchRec); ``sgd`` and ``adagrad`` match exactly.
"""

from towerrec.distributed.sharding.base import ShardingStrategy
from towerrec.planner.plan import ShardingType

COLUMN_WISE = ShardingStrategy(
    ShardingType.COLUMN_WISE, splits_rows=False, splits_cols=True, one_host=False
)
