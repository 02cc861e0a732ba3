"""Routing ids to the shards that own them, and back into a local batch.

For a plan, every model-parallel shard of a table holds one *slot* per feature
of the table. Rank r sends, to each rank d, a payload for d's slots::

    payload to d = [ lengths of slot 0 [B] | slot 1 [B] | ... | ids of slot 0 | slot 1 | ... ]
                   (ids shifted to the shard's local rows)

and rank d rebuilds one ``KeyedJaggedTensor`` of its slots over the samples of
every source, source-major inside each key::

    keys = d's slot features        lengths [K * sum_r B_r]      values (key-major)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from towerrec.distributed.mesh import Topology
from towerrec.distributed.sharding import strategy_for
from towerrec.modules.tables import TableConfig
from towerrec.planner.plan import ShardingPlan
from towerrec.sparse import KeyedJaggedTensor

__all__ = ["Router", "Slot", "segment_permutation"]


@dataclass(frozen=True)
class Slot:
    """One feature looked up in one shard: rows ``[rows)`` x cols ``[cols)`` on ``rank``."""

    feature: str
    table: str
    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    partial: bool  # the shard holds part of the rows: its pooled output is a partial sum
    hierarchical: bool = False  # partial sums are added inside the host before crossing hosts

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True)
class _FeatureRoute:
    row_starts: torch.Tensor  # [n] start row of each distinct row range, ascending
    boundaries: torch.Tensor  # [n - 1] row_starts[1:]
    targets: tuple[tuple[int, int, int], ...]  # (rank, slot index on rank, row range index)


class Router:
    """Static routing of the model-parallel tables of a plan (module doc)."""

    def __init__(
        self, tables: Sequence[TableConfig], plan: ShardingPlan, topology: Topology
    ) -> None:
        self.topology = topology
        self.slots: list[list[Slot]] = [[] for _ in range(topology.world_size)]
        self.features = [f for t in tables for f in t.feature_names]
        targets: dict[str, list[tuple[int, int, int]]] = {f: [] for f in self.features}
        self._routes: dict[str, _FeatureRoute] = {}
        for table in tables:
            table_plan = plan.tables[table.name]
            strategy = strategy_for(table_plan.sharding)
            strategy.check(table_plan, topology)
            ranges = sorted({s.rows for s in table_plan.shards})
            partial = len(ranges) > 1
            hierarchical = (
                strategy.one_host
                and strategy.splits_rows
                and topology.hosts > 1
                and topology.ranks_per_host > 1
                and sorted(s.rank for s in table_plan.shards)
                == topology.host_ranks(topology.host_of(table_plan.shards[0].rank))
            )
            for shard in table_plan.shards:
                for feature in table.feature_names:
                    slots = self.slots[shard.rank]
                    targets[feature].append((shard.rank, len(slots), ranges.index(shard.rows)))
                    slots.append(
                        Slot(
                            feature,
                            table.name,
                            shard.rank,
                            shard.rows,
                            shard.cols,
                            partial,
                            hierarchical,
                        )
                    )
            starts = torch.tensor([lo for lo, _ in ranges], dtype=torch.int64)
            for feature in table.feature_names:
                self._routes[feature] = _FeatureRoute(
                    starts, starts[1:].clone(), tuple(targets[feature])
                )

    def width(self, rank: int) -> int:
        """Columns of pooled output that ``rank`` sends straight to the samples' owners."""
        return sum(s.width for s in self.slots[rank] if not s.hierarchical)

    def host_slots(self, host: int) -> list[Slot]:
        """Hierarchical slots of ``host`` (the same features and columns on each of its ranks)."""
        first = self.topology.host_ranks(host)[0]
        return [s for s in self.slots[first] if s.hierarchical]

    @property
    def has_hierarchical(self) -> bool:
        return any(s.hierarchical for slots in self.slots for s in slots)

    def route(
        self, features: KeyedJaggedTensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[int]]:
        """Per destination rank: int64 payload, float weights (or None), number of ids.

        ``features`` holds exactly ``self.features`` in order, ids already in range.
        """
        world = self.topology.world_size
        batch = features.stride()
        values, lengths = features.values().long(), features.lengths().long()
        weights = features.weights_or_none()
        starts = features.offset_per_key()
        # Every slot is filled by exactly one route below.
        slot_lengths: list[list[Any]] = [[None] * len(s) for s in self.slots]
        slot_values: list[list[Any]] = [[None] * len(s) for s in self.slots]
        slot_weights: list[list[Any]] = [[None] * len(s) for s in self.slots]
        for i, feature in enumerate(self.features):
            v = values[starts[i] : starts[i + 1]]
            n = lengths[i * batch : (i + 1) * batch]
            w = weights[starts[i] : starts[i + 1]] if weights is not None else None
            route = self._routes[feature]
            if route.boundaries.numel() == 0:
                buckets = [(n, v, w)]
            else:
                buckets = _bucketize(v, n, w, route, batch)
            for rank, slot, bucket in route.targets:
                slot_lengths[rank][slot], slot_values[rank][slot], slot_weights[rank][slot] = (
                    buckets[bucket]
                )
        payload_weights: list[torch.Tensor] | None
        payloads, payload_weights, num_ids = [], [] if weights is not None else None, []
        empty = values.new_zeros(0)
        for rank in range(world):
            parts = slot_lengths[rank] + slot_values[rank]
            payloads.append(torch.cat(parts) if parts else empty)
            num_ids.append(sum(x.numel() for x in slot_values[rank]))
            if payload_weights is not None:
                assert weights is not None  # payload_weights exist only with weights
                ws = slot_weights[rank]
                payload_weights.append(torch.cat(ws) if ws else weights.new_zeros(0))
        return payloads, payload_weights, num_ids

    def assemble(
        self,
        received: torch.Tensor,
        batches: Sequence[int],
        num_ids: Sequence[int],
        weights: torch.Tensor | None,
    ) -> KeyedJaggedTensor:
        """The local batch of this rank's slots from the payloads of every source rank."""
        slots = self.slots[self.topology.rank]
        k = len(slots)
        blocks = received.split([k * b + n for b, n in zip(batches, num_ids)])
        lengths = [block[: k * b].view(k, b) for block, b in zip(blocks, batches)]
        values = [block[k * b :] for block, b in zip(blocks, batches)]
        merged_lengths = torch.cat(lengths, dim=1)  # [K, sum B]
        flat_values = torch.cat(values)
        if len(batches) > 1 and k > 1:
            # segments arrive (source, slot)-major; the kernel wants (slot, source)-major
            seg = torch.stack([ln.sum(dim=1) for ln in lengths])  # [W, K]
            index = segment_permutation(seg)
            flat_values = flat_values[index]
            if weights is not None:
                weights = weights[index]
        return KeyedJaggedTensor(
            [s.feature for s in slots],
            flat_values,
            merged_lengths.reshape(-1),
            weights,
            validate=False,
        )


def _bucketize(v, n, w, route: _FeatureRoute, batch: int):
    """Split one feature's bags by the row range of each id: ``[(lengths[B], ids, weights)]``
    per range, ids shifted to the range's first row, order within a bag kept."""
    count = route.row_starts.numel()
    sample = torch.repeat_interleave(torch.arange(batch, device=v.device), n, output_size=v.numel())
    bucket = torch.bucketize(v, route.boundaries.to(v.device), right=True)
    key = bucket * batch + sample
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=count * batch).view(count, batch)
    shifted = (v - route.row_starts.to(v.device)[bucket])[order]
    sizes = counts.sum(dim=1).tolist()
    ids = shifted.split(sizes)
    ws = w[order].split(sizes) if w is not None else [None] * count
    return [(counts[b], ids[b], ws[b]) for b in range(count)]


def segment_permutation(seg: torch.Tensor) -> torch.Tensor:
    """Gather index that reorders segments stored (row-major over ``seg[W, K]``) into
    (column-major) order: segment (w, k) of length ``seg[w, k]``."""
    flat = seg.reshape(-1)
    source_start = torch.cumsum(flat, 0) - flat  # start of (w, k) in arrival order
    target_len = seg.t().reshape(-1)
    target_start = torch.cumsum(target_len, 0) - target_len
    delta = source_start.view(seg.shape).t().reshape(-1) - target_start
    total = int(flat.sum())
    return torch.arange(total, device=seg.device) + torch.repeat_interleave(
        delta, target_len, output_size=total
    )
