"""What every sharding type answers, and the checks that several of them share.

Every model-parallel type is one routine with different geometry: a table's
shards are (row range x column range) blocks on ranks, and

    split         how a table becomes shards (``split``)
    input_dist    each id goes to every shard whose row range holds it, shifted
                  to the shard's local rows, for every column range (``route``)
    lookup        the shard's rank pools its ids with the fused kernel, with the
                  pooling of ``shard_pooling``
    output_dist   pooled partials return to the sample's owner, where column
                  ranges are placed side by side and row ranges summed
    validation    what makes a plan of the type invalid (``problems``)

One file per type (``table_wise.py``, ``row_wise.py``, ...) subclasses
``ShardingStrategy``; data-parallel is the exception (replicas, see
``data_parallel.py``). Everything here is pure: tensors in, tensors out, no
process group; the collectives live in ``towerrec.distributed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from towerrec.modules.tables import Pooling, TableConfig
from towerrec.sharding.types import Shard, ShardingType, TablePlan

__all__ = [
    "Bucket",
    "ShardingStrategy",
    "duplicate_rank_problems",
    "one_host_problems",
    "span_problems",
    "tiling_problems",
]

# One shard's part of a feature: (lengths [B], ids, per-id weights or None).
Bucket = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class ShardingStrategy(ABC):
    """One sharding type's logic (module doc). Instances are stateless singletons."""

    kind: ClassVar[ShardingType]
    splits_rows: ClassVar[bool] = False  # shards hold row ranges: pooled outputs are partial sums
    splits_cols: ClassVar[bool] = False  # shards hold column ranges: placed side by side
    one_host: ClassVar[bool] = False  # all shards on the ranks of one host
    replicated: ClassVar[bool] = False  # data-parallel: a full copy on every rank

    # ---------------------------------------------------------------- split
    @abstractmethod
    def split(self, table: TableConfig, ranks: Sequence[int]) -> tuple[Shard, ...]:
        """The usual shards of ``table`` over ``ranks`` (even row or column ranges)."""

    # ----------------------------------------------------------- validation
    def problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        """Everything that makes ``plan`` (of ``table``) invalid in a world of
        ``world_size`` ranks, ``ranks_per_host`` per host; empty when it is valid."""
        name = table.name
        if not plan.shards:
            return [f"table {name!r} has no shards"]
        out = []
        for s in plan.shards:
            if not 0 <= s.rank < world_size:
                out.append(f"table {name!r}: rank {s.rank} outside world of {world_size}")
            if not (
                0 <= s.rows[0] < s.rows[1] <= table.num_embeddings
                and 0 <= s.cols[0] < s.cols[1] <= table.embedding_dim
            ):
                out.append(
                    f"table {name!r}: shard {s.rows}x{s.cols} is empty or outside "
                    f"the table's {table.num_embeddings}x{table.embedding_dim}"
                )
        if out:
            return out
        return self.layout_problems(table, plan, world_size, ranks_per_host)

    @abstractmethod
    def layout_problems(
        self, table: TableConfig, plan: TablePlan, world_size: int, ranks_per_host: int
    ) -> list[str]:
        """The type's own rules, for shards that each lie inside the table and the world."""

    # ----------------------------------------------------------- input_dist
    def route(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        row_starts: torch.Tensor,
        boundaries: torch.Tensor,
        batch: int,
    ) -> list[Bucket]:
        """One feature's bags (``lengths [B]``, ``ids``) split by the table's row ranges
        (``row_starts`` ascending, ``boundaries = row_starts[1:]``): one ``Bucket`` per
        range. Without a row split every shard gets every id, as it is."""
        return [(lengths, ids, weights)]

    # --------------------------------------------------------------- lookup
    def shard_pooling(self, pooling: Pooling, partial: bool) -> Pooling:
        """The pooling a shard's kernel runs (``partial``: the table's rows are split)."""
        return pooling

    # ---------------------------------------------------------- output_dist
    def hierarchical(self, plan: TablePlan, hosts: int, ranks_per_host: int) -> bool:
        """Whether the table's partial sums are added inside a host before crossing hosts."""
        return False


# ------------------------------------------------------------ shared checks
def duplicate_rank_problems(name: str, plan: TablePlan) -> list[str]:
    ranks = plan.ranks
    if len(set(ranks)) != len(ranks):
        return [f"table {name!r}: a rank holds two shards of one {plan.sharding.value} table"]
    return []


def span_problems(table: TableConfig, plan: TablePlan, *, by_rows: bool) -> list[str]:
    """Shards split by rows span all columns; shards split by columns span all rows."""
    full_rows, full_cols = (0, table.num_embeddings), (0, table.embedding_dim)
    kind = plan.sharding.value
    if by_rows and any(s.cols != full_cols for s in plan.shards):
        return [f"table {table.name!r}: {kind} shards must span all columns"]
    if not by_rows and any(s.rows != full_rows for s in plan.shards):
        return [f"table {table.name!r}: {kind} shards must span all rows"]
    return []


def tiling_problems(table: TableConfig, plan: TablePlan, *, by_rows: bool) -> list[str]:
    """The shards' row (or column) ranges tile the table: no gap, no overlap."""
    name, kind = table.name, plan.sharding.value
    spans = sorted((s.rows if by_rows else s.cols) for s in plan.shards)
    size = table.num_embeddings if by_rows else table.embedding_dim
    position = 0
    for lo, hi in spans:
        if lo != position:
            return [
                f"table {name!r}: {kind} shards leave a gap or overlap at "
                f"{'row' if by_rows else 'column'} {min(lo, position)}"
            ]
        position = hi
    if position != size:
        return [f"table {name!r}: shards end at {position}, the table has {size}"]
    return []


def one_host_problems(
    name: str, plan: TablePlan, world_size: int, ranks_per_host: int
) -> list[str]:
    """All shards on the ranks of one host (the table-row-wise and table-column-wise rule)."""
    hosts = {r // ranks_per_host for r in plan.ranks if 0 <= r < world_size}
    if len(hosts) != 1:
        return [
            f"table {name!r}: {plan.sharding.value} shards must all be on one host, "
            f"got hosts {sorted(hosts)}; place them on the ranks of one host"
        ]
    return []
