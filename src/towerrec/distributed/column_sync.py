"""Exact row-wise optimizers for tables split by columns (the collectives of it).

``sgd``, ``adagrad`` and ``adam`` are exact per column. ``rowwise_adagrad`` keeps
one statistic per row, ``m[r] += mean_j g[r, j]^2`` over all D columns, which no
column shard sees alone (nor ``partial_rowwise_adam``'s ``m2[r]``);
``ColumnRowwiseSync`` makes it exact for every table
split by columns (column-wise, table-column-wise, in any plan)::

    lookup     each rank of the collection's group makes one fence per lookup:
               the kernels holding column shards take it as their autograd input
               and the rank's pooled output is tied to it, so its backward runs
               once on every rank, after all of the rank's kernels and the
               lookup's other collectives
    kernels    backward: the touched rows' gradients; the column shards' updates
               are deferred (``modules/kernels/``, PyTorch path on either backend)
    fence      partial[r] = sum over the shard's columns of g[r, j]^2 (one float per
               touched row); one all-to-all sends each partial to the table's other
               shards (they saw the same ids, so the same sorted rows); every shard
               adds the partials in plan order (the same bits everywhere) and applies
               m[r] += sum / D, w[r] -= lr g[r] / (sqrt(m[r]) + eps) (or the
               partial row-wise Adam step with that mean, ``optim/sparse.py``)

Every column shard of a table then holds the same row state, equal to the
unsharded table's, and a checkpoint stores it once (``state.py``). Traffic: a
table with k column shards and U distinct rows in the global batch costs each
shard (k - 1) * U * 4 bytes per step (``rowwise_stat`` in ``CommStats``).

Which tables need it, a shard's part of the statistic and their sum are the
column split's own logic (``towerrec.sharding.column_wise``); this file holds
the fence and the all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from towerrec.distributed.comm import Comm
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizer
from towerrec.sharding import ShardingPlan
from towerrec.sharding.column_wise import (
    row_statistic,
    row_statistic_part,
    rowwise_split_tables,
)

__all__ = ["ColumnRowwiseSync"]


class ColumnRowwiseSync:
    """Exact row-wise optimizers for the column-split tables of a plan (module doc)."""

    def __init__(
        self, comm: Comm, plan: ShardingPlan, tables: Sequence[TableConfig], device: torch.device
    ) -> None:
        self.comm = comm
        # table -> (full dim, ranks of its shards in plan order), in plan order
        self.tables = {
            t.name: (t.embedding_dim, [s.rank for s in plan.tables[t.name].shards]) for t in tables
        }
        self._leaf = torch.zeros(1, 0, device=device, requires_grad=True)
        self._step: _Step | None = None

    @staticmethod
    def split_tables(
        plan: ShardingPlan, tables: Sequence[TableConfig], optimizer: EmbeddingOptimizer
    ) -> list[TableConfig]:
        """The ``tables`` whose row-wise state needs combining under ``plan``."""
        return rowwise_split_tables(plan.tables, tables, optimizer.is_rowwise)

    def start(self) -> torch.Tensor:
        """Begin a lookup: its fence, to pass to ``tie`` (on every rank of the group)."""
        self._step = _Step(self)
        return self._step.trigger

    def step(self) -> _Step:
        assert self._step is not None, "a lookup starts (ColumnRowwiseSync.start) first"
        return self._step

    @staticmethod
    def tie(values: torch.Tensor, fence: torch.Tensor) -> torch.Tensor:
        """``values`` unchanged; in backward the fence also receives a gradient."""
        return _Tie.apply(values, fence)

    def finish(self, deferred: dict[str, tuple[torch.Tensor, Callable]]) -> None:
        """Combine the statistic over each table's shards and apply the updates."""
        comm, rank = self.comm, self.comm.rank
        mine = [(name, ranks) for name, (_, ranks) in self.tables.items() if rank in ranks]
        empty = self._leaf.new_zeros(0)
        partial = {
            name: row_statistic_part(deferred[name][0]) if name in deferred else empty
            for name, _ in mine
        }
        shared = [
            [name for name, ranks in mine if peer != rank and peer in ranks]
            for peer in range(comm.world_size)
        ]
        counts = [sum(partial[name].numel() for name in names) for names in shared]
        send = [partial[name] for names in shared for name in names]
        received = comm.all_to_all_async(
            torch.cat(send) if send else empty, counts, counts, "rowwise_stat"
        ).wait()
        pieces = iter(received.split([partial[name].numel() for names in shared for name in names]))
        from_peer = {
            (peer, name): next(pieces) for peer, names in enumerate(shared) for name in names
        }
        for name, ranks in mine:
            # plan order: every shard adds in the same order
            parts = [partial[name] if r == rank else from_peer[r, name] for r in ranks]
            statistic = row_statistic(parts, self.tables[name][0])
            if name in deferred:
                deferred[name][1](statistic)


class _Step:
    """One lookup's deferred updates (the kernels' ``RowwiseStep``)."""

    def __init__(self, sync: ColumnRowwiseSync) -> None:
        self.sync = sync
        self.deferred: dict[str, tuple[torch.Tensor, Callable]] = {}
        self.trigger = _Fence.apply(sync._leaf, self)

    def defer(self, table: str, grad: torch.Tensor, apply: Callable[[torch.Tensor], None]) -> None:
        assert table not in self.deferred, f"table {table!r} deferred twice in one lookup"
        self.deferred[table] = (grad, apply)

    def finish(self) -> None:
        deferred, self.deferred = self.deferred, {}
        self.sync.finish(deferred)


class _Fence(torch.autograd.Function):
    """Forward: an empty ``[1, 0]`` tensor. Backward (after every kernel that took it
    as input, and the ``_Tie``): combine and apply the deferred updates."""

    @staticmethod
    def forward(ctx, leaf, step: _Step):
        ctx.step = step
        return leaf.new_zeros(1, 0)

    @staticmethod
    def backward(ctx, grad):
        step, ctx.step = ctx.step, None  # the step holds this node through its trigger
        step.finish()
        return None, None


class _Tie(torch.autograd.Function):
    """Identity on ``values``; backward also hands the fence an (empty) gradient."""

    @staticmethod
    def forward(ctx, values, fence):
        ctx.fence_shape = fence.shape
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.fence_shape)
