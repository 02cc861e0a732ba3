"""input_dist of the sharded collection: ids to the shards that own them, and back into a
local batch.

For a plan, every model-parallel shard of a table holds one *slot* per feature
of the table. Rank r sends, to each rank d, a payload for d's slots::

    payload to d = the lengths [K_d, B], ids and per-id weights of d's K_d slots,
                   key-major (ids shifted to the shard's local rows), encoded by
                   ``IdWire`` (``id_wire.py``: narrow integer types, each slot's ids
                   deduplicated with an inverse index), then the data-parallel
                   features' payload (the same to every rank)

in one all-to-all once the sizes settle (``sized_exchange.py``: the sizes travel in
each message's head; the first batch, and any payload over the agreed capacity, needs
a second all-to-all for its rest),

and rank d rebuilds one ``KeyedJaggedTensor`` of its slots over the samples of
every source, source-major inside each key::

    keys = d's slot features        lengths [K * sum_r B_r]      values (key-major)

Where an id goes is its table's sharding type's answer (``towerrec.sharding``:
row splits bucketize, column splits replicate). Data-parallel features are
gathered whole (lengths + ids of the global batch on every rank, from the tail of
every message).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from towerrec.distributed.comm import Comm, Pending
from towerrec.distributed.id_wire import IdWire
from towerrec.distributed.mesh import Topology
from towerrec.distributed.sized_exchange import SizedExchange
from towerrec.modules.embedding_bag import IdPolicy, apply_id_policy, check_weighted_pooling
from towerrec.modules.tables import TableConfig
from towerrec.sharding import ShardingPlan, ShardingStrategy, strategy_for
from towerrec.sharding.row_wise import divided_at_owner, mean_divisor
from towerrec.sparse import KeyedJaggedTensor

__all__ = ["DistInput", "InputDist", "Router", "Slot", "assemble", "segment_permutation"]


@dataclass
class DistInput:
    """The result of ``input_dist`` for one local batch."""

    batch: int  # local samples B
    batches: list[int]  # B_r of every rank
    local: KeyedJaggedTensor | None  # this rank's slots over sum_r B_r samples
    replicated: KeyedJaggedTensor | None  # data-parallel features over the global batch
    divisor: torch.Tensor | None  # [B, sum D] bag lengths for row-split mean pooling


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
    strategy: ShardingStrategy  # the table's sharding type: where its ids go
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
            table_plan = plan.tables[table.name]  # validated (ShardingPlan.validate)
            strategy = strategy_for(table_plan.sharding)
            ranges = table_plan.row_ranges
            partial = len(ranges) > 1
            hierarchical = strategy.hierarchical(
                table_plan, topology.hosts, topology.ranks_per_host
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
                    strategy, starts, starts[1:].clone(), tuple(targets[feature])
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

    def route(self, features: KeyedJaggedTensor, wire: IdWire) -> list[torch.Tensor]:
        """Per destination rank: its slots' lengths, ids and per-id weights (if any)
        encoded by ``wire`` (uint8).

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
            buckets = route.strategy.route(v, n, w, route.row_starts, route.boundaries, batch)
            for rank, slot, bucket in route.targets:
                slot_lengths[rank][slot], slot_values[rank][slot], slot_weights[rank][slot] = (
                    buckets[bucket]
                )
        payloads = []
        for rank in range(world):
            ids = torch.cat(slot_values[rank]) if slot_values[rank] else values.new_zeros(0)
            bags = (
                torch.stack(slot_lengths[rank])
                if slot_lengths[rank]
                else lengths.new_zeros(0, batch)
            )
            ws = None
            if weights is not None:
                ws = torch.cat(slot_weights[rank]) if slot_weights[rank] else weights[:0]
            payloads.append(wire.encode(bags, ids, ws))
        return payloads

    def assemble(
        self, wire: IdWire, received: torch.Tensor, sizes: Sequence[int], batches: Sequence[int]
    ) -> KeyedJaggedTensor:
        """The local batch of this rank's slots from the payloads of every source rank
        (``sizes[r]`` bytes from rank r)."""
        features = [s.feature for s in self.slots[self.topology.rank]]
        parts, weights = wire.decode_all_weighted(received, sizes, len(features), batches)
        return assemble(features, parts, weights)


def assemble(
    keys: Sequence[str],
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    weights: torch.Tensor | None,
) -> KeyedJaggedTensor:
    """One ``KeyedJaggedTensor`` of ``keys`` over the samples of every source, from what
    each source sent, in source order: ``parts[r] = (lengths [K, B_r], ids [n_r])`` with
    the ids key-major (``IdWire.decode``), and ``weights`` (or None) the ids' weights in
    the same order."""
    k = len(keys)
    lengths = [ln for ln, _ in parts]
    merged_lengths = torch.cat(lengths, dim=1)  # [K, sum B]
    flat_values = torch.cat([v for _, v in parts])
    if len(parts) > 1 and k > 1:
        # segments arrive (source, key)-major; the kernel wants (key, source)-major
        seg = torch.stack([ln.sum(dim=1) for ln in lengths])  # [W, K]
        index = segment_permutation(seg)
        flat_values = flat_values[index]
        if weights is not None:
            weights = weights[index]
    return KeyedJaggedTensor(
        list(keys), flat_values, merged_lengths.reshape(-1), weights, validate=False
    )


class InputDist:
    """The input side of one sharded collection (module doc); made once, used per batch."""

    def __init__(
        self,
        router: Router,
        comm: Comm,
        tables: Sequence[TableConfig],
        replicated: Sequence[TableConfig],
        feature_names: Sequence[str],
        embedding_dims: Sequence[int],
        rows_per_feature: torch.Tensor,
        id_policy: IdPolicy,
        device: torch.device,
        wire: IdWire | None = None,
    ) -> None:
        self.router, self.comm, self.device = router, comm, device
        self.wire = wire or IdWire()
        self.exchange = SizedExchange(comm, "input_ids", "input_overflow")
        self.tables = list(tables)
        self.feature_names, self.embedding_dims = list(feature_names), list(embedding_dims)
        self.rows_per_feature, self.id_policy = rows_per_feature, id_policy
        self.sharded_features = router.features
        self.replicated_features = [f for t in replicated for f in t.feature_names]
        self.mean_partial = self._mean_partial_columns()

    def _mean_partial_columns(self) -> list[tuple[str, int, int]]:
        """(feature, first column, dim) of features divided by their bag length at the owner."""
        offsets, position = {}, 0
        for feature, dim in zip(self.feature_names, self.embedding_dims):
            offsets[feature] = position
            position += dim
        pooling = {f: t.pooling for t in self.tables for f in t.feature_names}
        dims = dict(zip(self.feature_names, self.embedding_dims))
        partial = {s.feature for slots in self.router.slots for s in slots if s.partial}
        return [
            (f, offsets[f], dims[f])
            for f in self.feature_names
            if divided_at_owner(pooling[f], f in partial)
        ]

    def start(self, features: KeyedJaggedTensor, settle: bool = False) -> Pending:
        """Start sending this batch's ids to their shards; ``.wait()`` gives a ``DistInput``.
        One message per destination once sizes settle (``sized_exchange.py``); ``settle``
        (a prefetch, received later at a point that may differ between ranks): the
        sizes are read, and any rest over the agreed capacity sent, before this returns."""
        if features.keys() != self.feature_names:
            features = features.select(self.feature_names)
        check_weighted_pooling(features, self.tables)
        values = apply_id_policy(features, self.rows_per_feature, self.id_policy)
        features = KeyedJaggedTensor(
            features.keys(), values, features.lengths(), features.weights_or_none(), validate=False
        )
        world, batch = self.comm.world_size, features.stride()
        sharded = features.select(self.sharded_features) if self.sharded_features else None
        replicated = features.select(self.replicated_features) if self.replicated_features else None
        wire = self.wire
        empty = torch.zeros(0, dtype=torch.uint8, device=values.device)
        payloads = self.router.route(sharded, wire) if sharded is not None else [empty] * world
        # data-parallel features: the same payload to every rank (an all-gather), after
        # the rank's own slots in one message
        replicated_payload = (
            wire.encode(
                replicated.lengths().view(len(self.replicated_features), batch),
                replicated.values(),
                replicated.weights_or_none(),
            )
            if replicated is not None
            else empty
        )
        flight = self.exchange.start(
            [torch.cat([p, replicated_payload]) for p in payloads],
            [[batch, p.numel()] for p in payloads],
            settle=settle,
        )
        divisor = self._divisor(features) if self.mean_partial else None

        def finish() -> DistInput:
            head = flight.heads()
            batches, sizes = head[:, 0].tolist(), head[:, 1].tolist()
            received = flight.received()
            local = glob = None
            if sharded is not None:
                mine = torch.cat([r[:size] for r, size in zip(received, sizes)])
                local = self.router.assemble(wire, mine, sizes, batches)
            if replicated is not None:
                keys = self.replicated_features
                rest = [r[size:] for r, size in zip(received, sizes)]
                parts, weights = wire.decode_all_weighted(
                    torch.cat(rest), [r.numel() for r in rest], len(keys), batches
                )
                glob = assemble(keys, parts, weights)
            return DistInput(batch, batches, local, glob, divisor)

        return Pending(None, finish)

    def _divisor(self, features: KeyedJaggedTensor) -> torch.Tensor:
        bags = [(features[f].lengths, start, dim) for f, start, dim in self.mean_partial]
        return mean_divisor(bags, features.stride(), sum(self.embedding_dims), self.device)


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
