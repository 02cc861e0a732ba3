"""Row-wise: row ranges of a table over all ranks.

::

    rank 0 [ rows 0..N/2 )   rank 1 [ rows N/2..N )

    split         even row ranges over the ranks given (the planner: over
                  min(world, N) ranks, ``planner_parts``), every shard all columns
    input_dist    each id goes to the rank owning its row (``bucketize``), shifted
                  to the shard's first row; the order of ids within a bag is kept
    lookup        every shard pools its ids into a partial sum (sum pooling even
                  for a mean-pooled table, ``shard_pooling``)
    output_dist   the owner of a sample adds the partials; mean pooling divides
                  the sum by the full bag length there (``mean_divisor``)
    invalid       shards that do not span all columns, or whose row ranges leave
                  a gap, overlap or stop short of the table; two shards on a rank

Table-row-wise (``table_row_wise.py``) is the same split over the ranks of one host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from towerrec.modules.tables import Pooling, TableConfig
from towerrec.sharding.base import (
    Bucket,
    ShardingStrategy,
    duplicate_rank_problems,
    span_problems,
    tiling_problems,
)
from towerrec.sharding.types import Shard, ShardingType, TablePlan, even_splits

__all__ = [
    "ROW_WISE",
    "RowWise",
    "bucketize",
    "mean_divisor",
    "planner_parts",
    "row_spans",
]


def row_spans(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous row ranges of ``num_rows`` rows, sizes differing by at most one."""
    return even_splits(num_rows, parts)


def planner_parts(world_size: int, num_rows: int) -> int:
    """How many ranks the planner splits a row-wise table over (no rank without a row)."""
    return min(world_size, num_rows)


def bucketize(
    ids: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    row_starts: torch.Tensor,
    boundaries: torch.Tensor,
    batch: int,
) -> list[Bucket]:
    """Split one feature's bags by the row range of each id: ``(lengths [B], ids, weights)``
    per range, ids shifted to the range's first row, order within a bag kept."""
    count = row_starts.numel()
    sample = torch.repeat_interleave(
        torch.arange(batch, device=ids.device), lengths, output_size=ids.numel()
    )
    bucket = torch.bucketize(ids, boundaries.to(ids.device), right=True)
    key = bucket * batch + sample
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=count * batch).view(count, batch)
    shifted = (ids - row_starts.to(ids.device)[bucket])[order]
    sizes = counts.sum(dim=1).tolist()
    split_ids = shifted.split(sizes)
    split_weights: Sequence[torch.Tensor | None] = (
        weights[order].split(sizes) if weights is not None else [None] * count
    )
    return [(counts[b], split_ids[b], split_weights[b]) for b in range(count)]


def mean_divisor(
    bags: Sequence[tuple[torch.Tensor, int, int]], batch: int, width: int, device: torch.device
) -> torch.Tensor:
    """``[B, width]`` divisors of the summed output: for each (bag lengths ``[B]``, first
    column, dim) of a mean-pooled feature whose rows are split, the bag length (at least
    1) over its columns; 1 elsewhere."""
    divisor = torch.ones(batch, width, device=device)
    for lengths, start, dim in bags:
        divisor[:, start : start + dim] = lengths.clamp(min=1).to(divisor.dtype).unsqueeze(1)
    return divisor


def divided_at_owner(pooling: Pooling, partial: bool) -> bool:
    """Whether a feature's output is divided by its bag length at the sample's owner."""
    return partial and pooling is Pooling.MEAN


class RowWise(ShardingStrategy):
    kind = ShardingType.ROW_WISE
    splits_rows = True

    def split(self, table: TableConfig, ranks: Sequence[int]) -> tuple[Shard, ...]:
        cols = (0, table.embedding_dim)
        spans = row_spans(table.num_embeddings, len(ranks))
        return tuple(Shard(r, span, cols) for r, span in zip(ranks, spans))

    def layout_problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        out = duplicate_rank_problems(table.name, plan)
        out += span_problems(table, plan, by_rows=True)
        return out + tiling_problems(table, plan, by_rows=True)

    def route(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        row_starts: torch.Tensor,
        boundaries: torch.Tensor,
        batch: int,
    ) -> list[Bucket]:
        if boundaries.numel() == 0:  # one row range: every id to it, as it is
            return [(lengths, ids, weights)]
        return bucketize(ids, lengths, weights, row_starts, boundaries, batch)

    def shard_pooling(self, pooling: Pooling, partial: bool) -> Pooling:
        return Pooling.SUM if partial else pooling


ROW_WISE = RowWise()
