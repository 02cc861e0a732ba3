"""Where a DMT tower's tables go inside its host: table-wise where that balances.

Under the tower transform host t holds tower t's tables and its L ranks look
them up for the peer batch (``P = N B`` samples per rank, ``L P`` = the global
batch per host). The candidates, costed by the planner's ``CostModel`` on one
host of L ranks:

- table-wise: each table whole on one rank, tables placed largest cost first on
  the least loaded rank (LPT); a rank pays its tables' lookups, updates and
  pooled outputs, and the kernel and shard overheads of its tables only;
- row-wise: each table split into L row ranges, one per rank; every rank pays
  1/L of every table's lookups and updates, but the partial sums of every
  table's pooled rows (the whole ``[P L, D]`` per table, not 1/L of it) and one
  shard overhead per table.

A rank's seconds are the sum of its shards' ``ShardCost.total`` and its device
overhead; a layout's seconds are its slowest rank's. The layout with the fewest
seconds wins, table-wise on a tie: table-wise wins whenever its tables spread
evenly enough that the slowest rank's extra share of lookups costs less than
row-wise's extra outputs and overheads, and loses to row-wise when one table
dominates. ``distributed.tower_sharding`` other than ``auto`` overrides the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from towerrec.planner.cost import CostModel
from towerrec.planner.stats import TableStats
from towerrec.sharding import ShardingType

__all__ = ["LAYOUT_CANDIDATES", "TowerLayout", "choose_tower_layout"]

LAYOUT_CANDIDATES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)


@dataclass(frozen=True)
class TowerLayout:
    """The chosen layout of one tower's tables over its host's ranks.

    ``ranks``: each table's host-local ranks (one for table-wise, all for row-wise);
    ``seconds``: each candidate's slowest-rank seconds per step; ``rank_seconds``: the
    chosen layout's seconds per rank."""

    sharding: ShardingType
    ranks: dict[str, list[int]]
    seconds: dict[str, float]
    rank_seconds: list[float]

    @property
    def imbalance(self) -> float:
        """Slowest rank's seconds over the mean rank's (1.0: perfectly even)."""
        mean = sum(self.rank_seconds) / len(self.rank_seconds)
        return max(self.rank_seconds) / mean if mean > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "sharding": self.sharding.value,
            "ranks": self.ranks,
            "seconds": self.seconds,
            "imbalance": self.imbalance,
        }


def _table_wise(
    stats: Sequence[TableStats], model: CostModel, ranks: int
) -> tuple[dict[str, list[int]], list[float]]:
    cost = {
        s.name: model.shard_cost(s, ShardingType.TABLE_WISE, s.num_embeddings, s.embedding_dim)
        for s in stats
    }
    load, widths, shards = [0.0] * ranks, [set[int]() for _ in range(ranks)], [0] * ranks
    placed: dict[str, list[int]] = {}
    for s in sorted(stats, key=lambda s: (-cost[s.name].total, s.name)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += cost[s.name].total
        widths[rank].add(s.embedding_dim)
        shards[rank] += 1
        placed[s.name] = [rank]
    seconds = [
        load[r] + (model.device_overhead(len(widths[r]), shards[r]) if shards[r] else 0.0)
        for r in range(ranks)
    ]
    return {s.name: placed[s.name] for s in stats}, seconds


def _row_wise(stats: Sequence[TableStats], model: CostModel, ranks: int) -> list[float]:
    seconds = []
    for r in range(ranks):
        total, widths, shards = 0.0, set(), 0
        for s in stats:
            rows = s.num_embeddings // ranks + (1 if r < s.num_embeddings % ranks else 0)
            if rows:
                total += model.shard_cost(s, ShardingType.ROW_WISE, rows, s.embedding_dim).total
                widths.add(s.embedding_dim)
                shards += 1
        seconds.append(total + (model.device_overhead(len(widths), shards) if shards else 0.0))
    return seconds


def choose_tower_layout(stats: Sequence[TableStats], model: CostModel) -> TowerLayout:
    """The layout of one tower's tables (``stats``, one per table) over the ranks of
    ``model``'s topology (one host; its ``batch_size`` the peer batch per rank)."""
    if not stats:
        raise ValueError("a tower needs at least one table to lay out")
    topology = model.topology
    if topology.hosts != 1:
        raise ValueError(
            f"a tower's tables are laid out inside one host; give a cost model of one host, "
            f"got {topology.hosts} hosts"
        )
    ranks = topology.ranks_per_host
    placed, table_wise = _table_wise(stats, model, ranks)
    row_wise = _row_wise(stats, model, ranks)
    seconds = {
        ShardingType.TABLE_WISE.value: max(table_wise),
        ShardingType.ROW_WISE.value: max(row_wise),
    }
    if max(table_wise) <= max(row_wise):
        return TowerLayout(ShardingType.TABLE_WISE, placed, seconds, table_wise)
    every = list(range(ranks))
    return TowerLayout(ShardingType.ROW_WISE, {s.name: every for s in stats}, seconds, row_wise)
