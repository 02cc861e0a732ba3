"""Data-parallel: a full replica of the table on every rank.

::

    every rank [ table A ]   (identical copies)
    input_dist    the ids of the whole global batch are gathered on every rank
    lookup        every rank pools the global batch and keeps its own samples
    backward      the gradients of every rank's samples are gathered, so every
                  replica applies the same exact fused update the unsharded
                  table would (replicas never drift apart)

Meant for small tables: the lookup runs over the global batch on every rank.
"""

from towerrec.distributed.sharding.base import ShardingStrategy
from towerrec.planner.plan import ShardingType

DATA_PARALLEL = ShardingStrategy(
    ShardingType.DATA_PARALLEL,
    splits_rows=False,
    splits_cols=False,
    one_host=False,
    replicated=True,
)
