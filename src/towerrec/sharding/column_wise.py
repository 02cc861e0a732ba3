"""Column-wise: column ranges of a table over ranks.

::

    rank 0 [ all rows x cols 0..D/2 )   rank 1 [ all rows x cols D/2..D )

    split         even column ranges over the ranks given (the planner: over
                  2..min(world, D) ranks, the fewest whose widest shard fits)
    input_dist    every id goes to every column shard, as it is
    lookup        each shard pools its columns with the table's pooling
    output_dist   the owner places the pooled column blocks side by side
    invalid       shards that do not span all rows, or whose column ranges leave
                  a gap, overlap or stop short of the table; two shards on a rank

``sgd``, ``adagrad`` and ``adam`` are exact per column. ``rowwise_adagrad`` keeps
one statistic per row, ``m[r] += mean_j g[r, j]^2`` over all D columns, which no
column shard sees alone (nor ``partial_rowwise_adam``'s ``m2[r]``): for the tables
of ``rowwise_split_tables`` each shard sends ``row_statistic_part`` of its
columns to the table's other shards, and every shard combines the parts in plan
order with ``row_statistic`` (the same bits everywhere). The exchange and the
deferred updates are ``towerrec.distributed.column_sync.ColumnRowwiseSync``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from towerrec.modules.tables import TableConfig
from towerrec.sharding.base import (
    ShardingStrategy,
    duplicate_rank_problems,
    span_problems,
    tiling_problems,
)
from towerrec.sharding.types import Shard, ShardingType, TablePlan, even_splits

__all__ = [
    "COLUMN_WISE",
    "ColumnWise",
    "column_spans",
    "row_statistic",
    "row_statistic_part",
    "rowwise_split_tables",
]


def column_spans(dim: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous column ranges of ``dim`` columns, widths differing by at most one."""
    return even_splits(dim, parts)


def rowwise_split_tables(
    plans: Mapping[str, TablePlan], tables: Iterable[TableConfig], rowwise: bool
) -> list[TableConfig]:
    """The ``tables`` split by columns whose row-wise optimizer state (``rowwise``) needs
    the statistic of all columns combined."""
    if not rowwise:
        return []
    return [t for t in tables if len(plans[t.name].column_ranges) > 1]


def row_statistic_part(grad: torch.Tensor) -> torch.Tensor:
    """One shard's part of the row statistic: ``sum_j g[r, j]^2`` over its columns ``[U]``."""
    return grad.square().sum(dim=1)


def row_statistic(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``mean_j g[r, j]^2`` over the table's ``dim`` columns from the shards' parts, added
    in the order given (plan order on every shard, so every shard gets the same bits)."""
    total: torch.Tensor | None = None
    for part in parts:
        total = part.clone() if total is None else total.add_(part)
    assert total is not None  # a column-split table has at least one shard
    return total / dim


class ColumnWise(ShardingStrategy):
    kind = ShardingType.COLUMN_WISE
    splits_cols = True

    def split(self, table: TableConfig, ranks: Sequence[int]) -> tuple[Shard, ...]:
        rows = (0, table.num_embeddings)
        spans = column_spans(table.embedding_dim, len(ranks))
        return tuple(Shard(r, rows, span) for r, span in zip(ranks, spans))

    def layout_problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        out = duplicate_rank_problems(table.name, plan)
        out += span_problems(table, plan, by_rows=False)
        return out + tiling_problems(table, plan, by_rows=False)


COLUMN_WISE = ColumnWise()
