"""What a sharding type means for the sharded collection's three stages.

Every model-parallel type is one routine with different geometry: a table's
shards are (row range x column range) blocks on ranks, and

    input_dist    each id goes to every shard whose row range holds it
                  (shifted to the shard's local row), for every column range
    lookup        the shard's rank pools its ids with the fused kernel
    output_dist   pooled partials return to the sample's owner, where column
                  ranges are placed side by side and row ranges summed

``ShardingStrategy`` records which of these a type uses and checks the plan
entry of one table; data-parallel is the exception (replicas, see
``data_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from towerrec.distributed.mesh import Topology
from towerrec.planner.plan import ShardingType, TablePlan

__all__ = ["ShardingStrategy"]


@dataclass(frozen=True)
class ShardingStrategy:
    kind: ShardingType
    splits_rows: bool  # shards hold row ranges: pooled outputs are partial sums
    splits_cols: bool  # shards hold column ranges: outputs are placed side by side
    one_host: bool  # all shards on the ranks of one host
    replicated: bool = False  # data-parallel: a full copy on every rank

    def check(self, plan: TablePlan, topology: Topology) -> None:
        """Raise ``ValueError`` if ``plan`` cannot run on ``topology``."""
        if self.one_host:
            hosts = {topology.host_of(s.rank) for s in plan.shards}
            if len(hosts) != 1:
                raise ValueError(
                    f"table {plan.table!r}: {self.kind.value} needs all shards on one host, got "
                    f"hosts {sorted(hosts)} for {topology.hosts} hosts of "
                    f"{topology.ranks_per_host} ranks; place them on ranks of one host"
                )
