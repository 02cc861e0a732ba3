"""output_dist of the sharded collection: pooled shard outputs back to the samples' owners.

::

    rank d: pooled [sum_r B_r, W_d]  (its slots, source-major rows)
      │ all-to-all (fp32 / fp16 / bf16 on the wire): rank r gets its B_r rows
      │ table-row-wise over a whole host: added inside the host first, then one
      │ message per sample crosses hosts (``hierarchical``)
      │ data-parallel replicas: this rank's rows of the global-batch output
      ▼
    received columns [B, sum_d W_d + W_host + W_dp] ─► output columns [B, sum(D_f)]:
      column ranges placed side by side, row ranges' partial sums added
      (``index_add``; a gather when no rows are split), mean pooling under a row
      split divided by the bag length (``sharding.row_wise.mean_divisor``)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from towerrec.distributed.comm import Comm, CommCodecs, Pending
from towerrec.distributed.input_dist import DistInput, Router
from towerrec.sharding.data_parallel import local_rows
from towerrec.sharding.table_row_wise import add_host_partials
from towerrec.sparse import KeyedTensor

__all__ = ["OutputDist", "ScaleGrad"]


class OutputDist:
    """The output side of one sharded collection (module doc); made once, used per batch."""

    def __init__(
        self,
        router: Router,
        comm: Comm,
        feature_names: Sequence[str],
        embedding_dims: Sequence[int],
        replicated: Sequence[tuple[str, int]],
        *,
        codecs: CommCodecs,
        grad_scale: float,
        device: torch.device,
    ) -> None:
        self.router, self.comm, self.codecs = router, comm, codecs
        self.grad_scale, self.device = grad_scale, device
        self.feature_names, self.embedding_dims = list(feature_names), list(embedding_dims)
        offsets, position = {}, 0
        for feature, dim in zip(self.feature_names, self.embedding_dims):
            offsets[feature] = position
            position += dim
        self.col_map = self._column_map(offsets, replicated)
        self.direct_cols, self.host_cols = self._direct_and_host_columns()
        # Without row splits the received columns are a permutation of the output's:
        # a gather (or nothing) instead of a scatter-add.
        total = sum(self.embedding_dims)
        self.col_gather: torch.Tensor | None = None
        self.col_identity = False
        if self.col_map.numel() == total and self.col_map.unique().numel() == total:
            gather = torch.argsort(self.col_map)
            self.col_identity = bool((gather == torch.arange(total, device=device)).all())
            self.col_gather = gather

    def _column_map(
        self, offsets: dict[str, int], replicated: Sequence[tuple[str, int]]
    ) -> torch.Tensor:
        """Output column of every column received: slots of rank 0, 1, ..., then replicas."""
        router = self.router
        columns: list[int] = []
        direct = [[s for s in slots if not s.hierarchical] for slots in router.slots]
        hierarchical = [router.host_slots(h) for h in range(self.comm.topology.hosts)]
        for slots in [*direct, *hierarchical]:
            for s in slots:
                start = offsets[s.feature]
                columns.extend(range(start + s.cols[0], start + s.cols[1]))
        for feature, dim in replicated:
            columns.extend(range(offsets[feature], offsets[feature] + dim))
        return torch.tensor(columns, dtype=torch.int64, device=self.device)

    def _direct_and_host_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns of this rank's pooled output sent directly, and those added inside the host."""
        direct: list[int]
        host: list[int]
        direct, host, position = [], [], 0
        for s in self.router.slots[self.comm.rank]:
            (host if s.hierarchical else direct).extend(range(position, position + s.width))
            position += s.width
        return (
            torch.tensor(direct, dtype=torch.int64, device=self.device),
            torch.tensor(host, dtype=torch.int64, device=self.device),
        )

    def start(
        self, dist_input: DistInput, pooled: torch.Tensor, replicated: torch.Tensor | None
    ) -> Pending:
        """Start the output all-to-all of a lookup's result; ``.wait()`` finishes it (the
        hierarchical and replicated parts run there) and gives the ``KeyedTensor``."""
        comm, batch, batches = self.comm, dist_input.batch, dist_input.batches
        hierarchical = None
        if self.router.has_hierarchical:
            hierarchical = pooled.index_select(1, self.host_cols)
            pooled = pooled.index_select(1, self.direct_cols)
        width = pooled.shape[1]
        widths = [self.router.width(r) for r in range(comm.world_size)]
        in_flight = comm.all_to_all_start(
            pooled.reshape(-1),
            [b * width for b in batches],
            [batch * w for w in widths],
            "output_pooled",
            self.codecs,
        )
        return Pending(
            None,
            lambda: self._finish(dist_input, in_flight.wait(), widths, hierarchical, replicated),
        )

    def _finish(
        self,
        dist_input: DistInput,
        received: torch.Tensor,
        widths: list[int],
        hierarchical: torch.Tensor | None,
        replicated: torch.Tensor | None,
    ) -> KeyedTensor:
        comm, batch, batches = self.comm, dist_input.batch, dist_input.batches
        parts = [
            p.view(batch, w) for p, w in zip(received.split([batch * w for w in widths]), widths)
        ]
        if hierarchical is not None:
            parts.append(self._hierarchical(hierarchical, batch, batches))
        if replicated is not None:
            first = sum(batches[: comm.rank])
            parts.append(
                _KeepLocalSamples.apply(replicated, comm, first, batch, batches, self.codecs)
            )
        columns = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if self.col_identity:
            out = columns
        elif self.col_gather is not None:
            out = columns.index_select(1, self.col_gather)
        else:  # row ranges' partial sums add up here
            out = torch.zeros(
                batch, sum(self.embedding_dims), device=self.device, dtype=columns.dtype
            )
            out = out.index_add(1, self.col_map, columns)
        if dist_input.divisor is not None:
            out = out / dist_input.divisor
        if self.grad_scale != 1.0 and out.requires_grad:
            out = ScaleGrad.apply(out, self.grad_scale)
        return KeyedTensor(self.feature_names, self.embedding_dims, out)

    def _hierarchical(self, pooled: torch.Tensor, batch: int, batches: list[int]) -> torch.Tensor:
        """Table-row-wise partial sums ``[sum_r B_r, W_host]``: added inside the host, then
        one message per sample crosses hosts (rank l of a host serves the samples of
        rank l of every host). Returns ``[B, sum over hosts of W_host]``."""
        comm, topology = self.comm, self.comm.topology
        world, local, per_host = comm.world_size, topology.local_rank, topology.ranks_per_host
        width = pooled.shape[1]
        starts = [sum(batches[:r]) for r in range(world)]
        groups = [[r for r in range(world) if r % per_host == m] for m in range(per_host)]
        rows = [sum(batches[r] for r in g) for g in groups]
        order = torch.cat(
            [
                torch.arange(starts[r], starts[r] + batches[r], device=pooled.device)
                for g in groups
                for r in g
            ]
        )
        mine = topology.host_ranks(topology.host)
        send = [rows[r % per_host] * width if r in mine else 0 for r in range(world)]
        recv = [rows[local] * width if r in mine else 0 for r in range(world)]
        gathered = comm.all_to_all(
            pooled.index_select(0, order).reshape(-1), send, recv, "output_host_reduce", self.codecs
        )
        summed = add_host_partials(gathered, per_host, rows[local], width)
        widths = [sum(s.width for s in self.router.host_slots(h)) for h in range(topology.hosts)]
        send = [batches[r] * width if r in groups[local] else 0 for r in range(world)]
        recv = [
            batch * widths[topology.host_of(r)] if r % per_host == local else 0
            for r in range(world)
        ]
        received = comm.all_to_all(summed.reshape(-1), send, recv, "output_cross_host", self.codecs)
        blocks = received.split([batch * w for w in widths])
        return torch.cat([b.view(batch, w) for b, w in zip(blocks, widths)], dim=1)


class _KeepLocalSamples(torch.autograd.Function):
    """Forward: this rank's rows of a replica's global-batch output. Backward: the
    gradients of every rank's rows, gathered, so each replica updates as the
    unsharded table would on the global batch."""

    @staticmethod
    def forward(ctx, full, comm: Comm, first, batch, batches, codecs: CommCodecs):
        ctx.comm, ctx.batches, ctx.codecs, ctx.width = comm, batches, codecs, full.shape[1]
        return local_rows(full, first, batch)

    @staticmethod
    def backward(ctx, grad):
        comm, width, world = ctx.comm, ctx.width, ctx.comm.world_size
        flat = grad.contiguous().reshape(-1)
        gathered = comm.all_to_all_async(
            flat.repeat(world) if world > 1 else flat,
            [flat.numel()] * world,
            [b * width for b in ctx.batches],
            "replicated_grad",
            ctx.codecs.backward,
        ).wait()
        return gathered.view(-1, width), None, None, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None
