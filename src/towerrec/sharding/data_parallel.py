"""Data-parallel: a full replica of the table on every rank.

::

    every rank [ table A ]   (identical copies)

    split         a full-table shard on each rank given (a plan: every rank)
    input_dist    the ids of the whole global batch are gathered on every rank
    lookup        every rank pools the global batch with a full replica
    output_dist   every rank keeps its own samples' rows (``local_rows``); in
                  backward the gradients of every rank's samples are gathered, so
                  every replica applies the same exact fused update the unsharded
                  table would (replicas never drift apart)
    invalid       anything but one full replica on each rank of the world

Meant for small tables: the lookup runs over the global batch on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from towerrec.modules.tables import TableConfig
from towerrec.sharding.base import ShardingStrategy
from towerrec.sharding.types import Shard, ShardingType, TablePlan

__all__ = ["DATA_PARALLEL", "DataParallel", "local_rows"]


def local_rows(full: torch.Tensor, first: int, batch: int) -> torch.Tensor:
    """This rank's ``batch`` samples, from ``first`` on, of a global-batch output ``[G, W]``."""
    return full[first : first + batch].clone()


class DataParallel(ShardingStrategy):
    kind = ShardingType.DATA_PARALLEL
    replicated = True

    def split(self, table: TableConfig, ranks: Sequence[int]) -> tuple[Shard, ...]:
        rows, cols = (0, table.num_embeddings), (0, table.embedding_dim)
        return tuple(Shard(r, rows, cols) for r in ranks)

    def layout_problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        full_rows, full_cols = (0, table.num_embeddings), (0, table.embedding_dim)
        if sorted(plan.ranks) != list(range(world_size)) or any(
            s.rows != full_rows or s.cols != full_cols for s in plan.shards
        ):
            return [
                f"table {table.name!r}: data_parallel needs a full replica on each of the "
                f"{world_size} ranks exactly once"
            ]
        return []


DATA_PARALLEL = DataParallel()
