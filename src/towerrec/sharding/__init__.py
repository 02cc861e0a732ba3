"""Sharding strategies: the plan types and one file per sharding type.

Pure (no process group, no planner, no collectives): ``planner/`` makes plans of
these types, ``distributed/`` runs them. Where is a table sharded row-wise?
``row_wise.py``: its split, its id routing, how its partial outputs combine
and what makes a row-wise plan invalid.

    types.py              ShardingType, Shard, TablePlan, even_splits
    plan.py               ShardingPlan (validate, JSON), plan_table
    base.py               ShardingStrategy: what every type answers; shared checks
    table_wise.py  row_wise.py  column_wise.py
    table_row_wise.py  table_column_wise.py  data_parallel.py
    strategies.py         the strategy of each type (strategy_for)
"""

from towerrec.sharding.base import ShardingStrategy
from towerrec.sharding.plan import ShardingPlan, plan_table
from towerrec.sharding.strategies import STRATEGIES, TOWER_SHARDINGS, strategy_for
from towerrec.sharding.types import Shard, ShardingType, TablePlan, even_splits

__all__ = [
    "STRATEGIES",
    "TOWER_SHARDINGS",
    "Shard",
    "ShardingPlan",
    "ShardingStrategy",
    "ShardingType",
    "TablePlan",
    "even_splits",
    "plan_table",
    "strategy_for",
]
