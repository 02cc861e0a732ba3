"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection split over ranks by a plan.

::

    local batch KeyedJaggedTensor (B samples)
      │ input_dist   ids checked (id policy), routed to the shards that own them:
      │              count exchange, then all-to-all of lengths+ids (and weights);
      │              data-parallel features: the global batch's ids gathered
      ▼
    lookup           this rank's shards: one local EmbeddingBagCollection (fused
      │              kernels, optimizer in backward) over sum_r B_r samples;
      │              data-parallel tables: a full replica over the global batch
      ▼
    output_dist      pooled shard outputs all-to-all back to the samples' owners
      │              (fp32 / fp16 / bf16 on the wire), column ranges placed side
      │              by side, row ranges summed (mean pooling divided at the owner)
      ▼
    KeyedTensor [B, sum(D_f)]   same keys and layout as the unsharded collection

Backward runs the same collectives in reverse (autograd functions), so every
shard's fused optimizer sees exactly the gradient rows it owns, summed over
the samples of every rank: the updates equal the unsharded collection's on the
global batch. ``rowwise_adagrad`` (and ``partial_rowwise_adam``) under column
splits adds one all-to-all of a float per touched row at the end of the
lookup's backward (``sharding/column_wise.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count

import torch

from towerrec.distributed.comm import Comm, CommCodecs, CommStats, Pending
from towerrec.distributed.input_dist import Router, segment_permutation
from towerrec.distributed.sharding.column_wise import ColumnRowwiseSync
from towerrec.distributed.state import load_tensor, state_tensors
from towerrec.modules.embedding_bag import (
    EmbeddingBagCollection,
    IdPolicy,
    apply_id_policy,
    check_weighted_pooling,
)
from towerrec.modules.interfaces import FusedEmbeddingCollection
from towerrec.modules.kernels import Backend
from towerrec.modules.tables import Pooling, TableConfig, fill_table_block
from towerrec.planner.plan import Shard, ShardingPlan, ShardingType
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor

__all__ = ["DistInput", "ScaleGrad", "ShardView", "ShardedEmbeddingBagCollection"]


@dataclass
class DistInput:
    """The result of ``input_dist`` for one local batch."""

    batch: int  # local samples B
    batches: list[int]  # B_r of every rank
    local: KeyedJaggedTensor | None  # this rank's slots over sum_r B_r samples
    replicated: KeyedJaggedTensor | None  # data-parallel features over the global batch
    divisor: torch.Tensor | None  # [B, sum D] bag lengths for row-split mean pooling


@dataclass(frozen=True)
class ShardView:
    """One shard stored on this rank: views of its weights and optimizer state."""

    table: str
    shard: Shard
    weight: torch.Tensor  # [rows, cols]
    state: dict[str, torch.Tensor]  # canonical name -> [rows] or [rows, cols]


class ShardedEmbeddingBagCollection(FusedEmbeddingCollection):
    """The sharded twin of ``ebc`` under ``plan`` (module doc); made on every rank.

    Each rank allocates only its own shards. If ``ebc`` holds its tables, their
    weights and optimizer state (identical on every rank) are copied into the
    shards; if it was built with ``materialize=False`` (as distributed runs build
    it), every shard initialises itself from the tables' seeded init
    (``fill_table_block``), bit-identical to the blocks of the full tables, and
    no rank ever holds a full table (data-parallel replicas excepted).
    ``grad_scale`` multiplies the gradients that reach the embeddings
    (``parallelize`` sets 1/world so they match DDP's averaged dense gradients).

    A ``PooledEmbeddingCollection``, a ``FusedEmbeddingCollection`` and a
    ``PrefetchingCollection`` (``modules/interfaces.py``).
    """

    _local: EmbeddingBagCollection | None
    _replica: EmbeddingBagCollection | None

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        plan: ShardingPlan,
        comm: Comm,
        *,
        codecs: CommCodecs | None = None,
        grad_scale: float = 1.0,
    ) -> None:
        super().__init__()
        topology = comm.topology
        if (plan.world_size, plan.hosts) != (topology.world_size, topology.hosts):
            raise ValueError(
                f"the plan is for {plan.world_size} ranks on {plan.hosts} hosts but this run has "
                f"{topology.world_size} ranks on {topology.hosts} hosts; make a plan for this "
                "world (or run with --nproc/--hosts matching the plan)"
            )
        plan.validate(ebc.tables)
        self.comm = comm
        self.codecs = codecs or CommCodecs()
        self.grad_scale = grad_scale
        self.plan = plan
        self.tables = list(ebc.tables)
        self.optimizer = ebc.optimizer
        self.backend = ebc.backend
        self.id_policy = ebc.id_policy
        self.seed = ebc.seed
        self.device = ebc.device
        self.feature_names = list(ebc.feature_names)
        self.embedding_dims = list(ebc.embedding_dims)
        self._rows_per_feature = ebc._rows_per_feature
        replicated = {
            n for n, tp in plan.tables.items() if tp.sharding is ShardingType.DATA_PARALLEL
        }
        sharded_tables = [t for t in self.tables if t.name not in replicated]
        replicated_tables = [t for t in self.tables if t.name in replicated]
        self._router = Router(sharded_tables, plan, topology)
        self._sharded_features = self._router.features
        self._replicated_features = [f for t in replicated_tables for f in t.feature_names]
        # Plain attributes, not submodules: the shards' state is ours to name (see state.py).
        object.__setattr__(self, "_local", self._build_local(ebc, sharded_tables))
        object.__setattr__(self, "_replica", self._build_replica(ebc, replicated_tables))
        split = ColumnRowwiseSync.split_tables(plan, sharded_tables, self.optimizer.kind)
        self._rowwise = ColumnRowwiseSync(comm, plan, split, self.device) if split else None
        if self._rowwise is not None and self._local is not None:
            self._local.defer_rowwise({t.name for t in split}, self._rowwise)
        self._col_map = self._column_map()
        self._split_columns = self._direct_and_host_columns()
        # Without row splits the received columns are a permutation of the output's:
        # a gather (or nothing) instead of a scatter-add.
        total = sum(self.embedding_dims)
        self._col_gather: torch.Tensor | None = None
        self._col_identity = False
        if self._col_map.numel() == total and self._col_map.unique().numel() == total:
            gather = torch.argsort(self._col_map)
            self._col_identity = bool((gather == torch.arange(total, device=self.device)).all())
            self._col_gather = gather
        self._mean_partial = self._mean_partial_columns()
        # Prefetched input_dists by key, and the key the next forward takes (if any).
        self._prefetched: dict[int, tuple[Pending, CommStats, tuple[object, ...]]] = {}
        self._prefetch_keys = count()
        self._next_prefetched: int | None = None

    # ------------------------------------------------------------- building
    def _kernel_args(self) -> dict:
        return {
            "backend": self.backend,
            "device": self.device,
            "id_policy": IdPolicy.ERROR,
            "seed": self.seed,
        }

    def _build_local(
        self, ebc: EmbeddingBagCollection, tables: list[TableConfig]
    ) -> EmbeddingBagCollection | None:
        rank = self.comm.rank
        mine = {s.table: s for s in self._router.slots[rank]}
        shard_tables = []
        for table in tables:
            if table.name not in mine:
                continue
            slot = mine[table.name]
            if self.backend is Backend.FBGEMM and slot.width % 4:
                raise ValueError(
                    f"table {table.name!r}: its shard on rank {rank} has {slot.width} columns, "
                    "but FBGEMM kernels need a multiple of 4; split its columns into fewer "
                    "shards or set embedding.backend = 'torch'"
                )
            pooling = Pooling.SUM if slot.partial else table.pooling
            shard_tables.append(
                TableConfig(
                    table.name,
                    slot.rows[1] - slot.rows[0],
                    slot.width,
                    table.feature_names,
                    pooling,
                    table.init,
                    table.scale,
                )
            )
        if not shard_tables:
            return None
        local = EmbeddingBagCollection(
            shard_tables, self.optimizer, **self._kernel_args(), materialize=False
        ).materialize(init=False)
        if not ebc.is_materialized:
            by_name = {t.name: t for t in tables}
            with torch.no_grad():
                for view in self._views(local):
                    table = by_name[view.table]
                    fill_table_block(
                        view.weight, table, self.seed, view.shard.rows, view.shard.cols
                    )
                    for s in view.state.values():
                        s.zero_()
            return local
        weights, states = ebc.table_weights(), ebc.optimizer_state_dict()
        with torch.no_grad():
            for view in self._views(local):
                (r0, r1), (c0, c1) = view.shard.rows, view.shard.cols
                view.weight.copy_(weights[view.table][r0:r1, c0:c1])
                for name, s in view.state.items():
                    full = states[f"embedding_bags.{view.table}.{name}"]
                    if full.dim() == 2:
                        full = full[r0:r1, c0:c1]
                    elif full.dim() == 1:
                        full = full[r0:r1]
                    s.copy_(full)  # a scalar, the kernels' step, as it is
        return local

    def _build_replica(
        self, ebc: EmbeddingBagCollection, tables: list[TableConfig]
    ) -> EmbeddingBagCollection | None:
        if not tables:
            return None
        # Built from the same tables and seed, a replica initialises itself as ``ebc`` did.
        replica = EmbeddingBagCollection(tables, self.optimizer, **self._kernel_args())
        if not ebc.is_materialized:
            return replica
        weights, states = ebc.table_weights(), ebc.optimizer_state_dict()
        with torch.no_grad():
            for name, w in replica.table_weights().items():
                w.copy_(weights[name])
            replica.load_optimizer_state_dict(
                {k: v for k, v in states.items() if k in replica.optimizer_state_dict()}
            )
        return replica

    def _views(self, local: EmbeddingBagCollection | None) -> Iterator[ShardView]:
        if local is None:
            return
        rank = self.comm.rank
        states = local.optimizer_state_dict()
        for name, weight in local.table_weights().items():
            shard = next(s for s in self.plan.tables[name].shards if s.rank == rank)
            prefix = f"embedding_bags.{name}."
            state = {k[len(prefix) :]: v for k, v in states.items() if k.startswith(prefix)}
            yield ShardView(name, shard, weight, state)

    def _feature_offsets(self) -> dict[str, int]:
        offsets, position = {}, 0
        for feature, dim in zip(self.feature_names, self.embedding_dims):
            offsets[feature] = position
            position += dim
        return offsets

    def _column_map(self) -> torch.Tensor:
        """Output column of every column received: slots of rank 0, 1, ..., then replicas."""
        offsets = self._feature_offsets()
        columns: list[int] = []
        direct = [[s for s in slots if not s.hierarchical] for slots in self._router.slots]
        hierarchical = [self._router.host_slots(h) for h in range(self.comm.topology.hosts)]
        for slots in [*direct, *hierarchical]:
            for s in slots:
                start = offsets[s.feature]
                columns.extend(range(start + s.cols[0], start + s.cols[1]))
        if self._replica is not None:
            for feature, dim in zip(self._replica.feature_names, self._replica.embedding_dims):
                columns.extend(range(offsets[feature], offsets[feature] + dim))
        return torch.tensor(columns, dtype=torch.int64, device=self.device)

    def _direct_and_host_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns of this rank's pooled output sent directly, and those added inside the host."""
        direct: list[int]
        host: list[int]
        direct, host, position = [], [], 0
        for s in self._router.slots[self.comm.rank]:
            (host if s.hierarchical else direct).extend(range(position, position + s.width))
            position += s.width
        return (
            torch.tensor(direct, dtype=torch.int64, device=self.device),
            torch.tensor(host, dtype=torch.int64, device=self.device),
        )

    def _mean_partial_columns(self) -> list[tuple[str, int, int]]:
        """(feature, first column, dim) of features whose mean pooling is split by rows."""
        offsets = self._feature_offsets()
        pooling = {f: t.pooling for t in self.tables for f in t.feature_names}
        dims = dict(zip(self.feature_names, self.embedding_dims))
        partial = {s.feature for slots in self._router.slots for s in slots if s.partial}
        return [
            (f, offsets[f], dims[f])
            for f in self.feature_names
            if f in partial and pooling[f] is Pooling.MEAN
        ]

    # ----------------------------------------------------------- accessors
    @property
    def num_embedding_parameters(self) -> int:
        return sum(t.num_parameters for t in self.tables)

    def shard_views(self) -> list[ShardView]:
        """Every shard stored on this rank (data-parallel replicas as full-table shards)."""
        views = list(self._views(self._local))
        if self._replica is not None:
            states = self._replica.optimizer_state_dict()
            for table in self._replica.tables:
                prefix = f"embedding_bags.{table.name}."
                views.append(
                    ShardView(
                        table.name,
                        Shard(self.comm.rank, (0, table.num_embeddings), (0, table.embedding_dim)),
                        self._replica.table_weights()[table.name],
                        {k[len(prefix) :]: v for k, v in states.items() if k.startswith(prefix)},
                    )
                )
        return views

    def set_learning_rate(self, lr: float) -> None:
        for module in (self._local, self._replica):
            if module is not None:
                module.set_learning_rate(lr)

    # ---------------------------------------------------------- state dict
    def optimizer_state_dict(self, prefix: str = "") -> dict[str, object]:
        return state_tensors(self, "optimizer", prefix)

    def load_optimizer_state_dict(self, state: dict[str, object], prefix: str = "") -> None:
        expected = self.optimizer_state_dict(prefix)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(
                f"embedding optimizer state is missing {missing[:5]}; was it saved with "
                "another optimizer or other tables?"
            )
        for key in expected:
            load_tensor(self, key, state[key], prefix)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination.update(state_tensors(self, "weight", prefix))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        ours = f"{prefix}embedding_bags."
        own = set(state_tensors(self, "weight", prefix))
        for key in sorted(own):
            if key not in state_dict:
                missing_keys.append(key)
                continue
            try:
                load_tensor(self, key, state_dict[key], prefix)
            except ValueError as e:
                error_msgs.append(str(e))
        unexpected_keys.extend(k for k in state_dict if k.startswith(ours) and k not in own)

    # ------------------------------------------------------------- forward
    def input_dist(self, features: KeyedJaggedTensor) -> Pending:
        """Start sending this batch's ids to their shards; ``.wait()`` gives a ``DistInput``."""
        if features.keys() != self.feature_names:
            features = features.select(self.feature_names)
        check_weighted_pooling(features, self.tables)
        values = apply_id_policy(features, self._rows_per_feature, self.id_policy)
        features = KeyedJaggedTensor(
            features.keys(), values, features.lengths(), features.weights_or_none(), validate=False
        )
        comm, world, batch = self.comm, self.comm.world_size, features.stride()
        sharded = features.select(self._sharded_features) if self._sharded_features else None
        replicated = (
            features.select(self._replicated_features) if self._replicated_features else None
        )
        payloads, payload_weights, num_ids = (
            self._router.route(sharded) if sharded is not None else ([], None, [0] * world)
        )
        replicated_payload = (
            torch.cat([replicated.lengths().long(), replicated.values().long()])
            if replicated is not None
            else values.new_zeros(0)
        )
        counts = torch.tensor(
            [
                [
                    batch,
                    payloads[r].numel() if payloads else 0,
                    num_ids[r],
                    replicated_payload.numel(),
                ]
                for r in range(world)
            ],
            dtype=torch.int64,
        )
        received = comm.exchange_counts(counts.to(self.device), "input_counts").cpu()
        batches = received[:, 0].tolist()
        ids = weights = replicated_ids = replicated_weights = None
        if sharded is not None:
            send = [p.numel() for p in payloads]
            ids = comm.all_to_all_async(
                torch.cat(payloads), send, received[:, 1].tolist(), "input_ids"
            )
            if payload_weights is not None:
                weights = comm.all_to_all_async(
                    torch.cat(payload_weights), num_ids, received[:, 2].tolist(), "input_weights"
                )
        if replicated is not None:
            got = received[:, 3].tolist()
            replicated_ids = comm.all_gather_async(replicated_payload, got, "input_replicated")
            if replicated.weights_or_none() is not None:
                lengths = len(self._replicated_features)
                counts_of = [g - b * lengths for g, b in zip(got, batches)]
                replicated_weights = comm.all_gather_async(
                    replicated.weights(), counts_of, "input_weights"
                )
        divisor = self._divisor(features) if self._mean_partial else None

        def finish() -> DistInput:
            local = glob = None
            if ids is not None:
                local = self._router.assemble(
                    ids.wait(),
                    batches,
                    received[:, 2].tolist(),
                    weights.wait() if weights is not None else None,
                )
            if replicated_ids is not None:
                glob = self._gather_replicated(
                    replicated_ids.wait(),
                    batches,
                    replicated_weights.wait() if replicated_weights is not None else None,
                )
            return DistInput(batch, batches, local, glob, divisor)

        return Pending(None, finish)

    def _gather_replicated(
        self, data: torch.Tensor, batches: list[int], weights: torch.Tensor | None
    ) -> KeyedJaggedTensor:
        num = len(self._replicated_features)
        blocks, position = [], 0
        for b in batches:
            lengths = data[position : position + num * b]
            total = int(lengths.sum())
            blocks.append(
                (lengths.view(num, b), data[position + num * b : position + num * b + total])
            )
            position += num * b + total
        lengths = torch.cat([ln for ln, _ in blocks], dim=1)
        values = torch.cat([v for _, v in blocks])
        if len(batches) > 1 and num > 1:
            index = segment_permutation(torch.stack([ln.sum(dim=1) for ln, _ in blocks]))
            values = values[index]
            weights = weights[index] if weights is not None else None
        return KeyedJaggedTensor(
            self._replicated_features, values, lengths.reshape(-1), weights, validate=False
        )

    def _divisor(self, features: KeyedJaggedTensor) -> torch.Tensor:
        batch = features.stride()
        divisor = torch.ones(batch, sum(self.embedding_dims), device=self.device)
        for feature, start, dim in self._mean_partial:
            lengths = features[feature].lengths.clamp(min=1).to(divisor.dtype)
            divisor[:, start : start + dim] = lengths.unsqueeze(1)
        return divisor

    def prefetch(self, features: KeyedJaggedTensor) -> int:
        """Start ``input_dist`` of a batch that a later forward will take; returns its key
        (see ``use_prefetched``). Every rank must prefetch the same sequence of batches."""
        held = CommStats()  # counted when the batch is trained, not while it waits
        with self.comm.recording_into(held):
            pending = self.input_dist(features)
        key = next(self._prefetch_keys)
        self._prefetched[key] = (pending, held, _shape_of(features))
        return key

    def use_prefetched(self, key: int) -> None:
        """Make the next forward take the input_dist prefetched under ``key``; that
        forward must be of the features given to ``prefetch``."""
        if key not in self._prefetched:
            raise KeyError(f"no input_dist was prefetched under key {key} (or it was used)")
        self._next_prefetched = key

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.forward_start(features).wait()

    def forward_start(self, features: KeyedJaggedTensor) -> Pending:
        """``forward`` begun: input_dist (or its prefetched result), lookup, and the output
        all-to-all started; ``.wait()`` gives the ``KeyedTensor``. A model computes its
        dense layers in between (the all-to-all overlaps them)."""
        key, self._next_prefetched = self._next_prefetched, None
        if key is not None:
            pending, held, shape = self._prefetched.pop(key)
            assert shape == _shape_of(features), "the forward is not of the prefetched batch"
            self.comm.stats.merge(held)
        else:
            pending = self.input_dist(features)
        return self.output_dist_start(self.lookup(pending.wait()))

    def lookup(self, dist_input: DistInput) -> tuple[DistInput, torch.Tensor, torch.Tensor | None]:
        """Pool this rank's shards: ``[sum_r B_r, W_rank]`` and replicas ``[sum_r B_r, W_dp]``."""
        total = sum(dist_input.batches)
        fence = self._rowwise.start() if self._rowwise is not None else None
        if self._local is not None and dist_input.local is not None:
            pooled = self._local(dist_input.local)
            order = [s.feature for s in self._router.slots[self.comm.rank]]
            values = pooled.values()
            if pooled.keys() != order:
                values = torch.cat([pooled[f] for f in order], dim=1)
        else:
            # Nothing stored here: an empty leaf keeps this rank in the backward all-to-all.
            values = torch.zeros(
                total, 0, device=self.device, requires_grad=torch.is_grad_enabled()
            )
        if fence is not None and torch.is_grad_enabled():
            values = ColumnRowwiseSync.tie(values, fence)  # the fence runs on every rank
        replicated = None
        if self._replica is not None:
            replicated = self._replica(dist_input.replicated).values()
        return dist_input, values, replicated

    def output_dist(self, looked_up) -> KeyedTensor:
        return self.output_dist_start(looked_up).wait()

    def output_dist_start(self, looked_up) -> Pending:
        """Start the output all-to-all of ``lookup``'s result; ``.wait()`` finishes
        ``output_dist`` (the hierarchical and replicated parts run there)."""
        dist_input, pooled, replicated = looked_up
        comm, batch, batches = self.comm, dist_input.batch, dist_input.batches
        hierarchical = None
        if self._router.has_hierarchical:
            direct_cols, host_cols = self._split_columns
            hierarchical = pooled.index_select(1, host_cols)
            pooled = pooled.index_select(1, direct_cols)
        width = pooled.shape[1]
        widths = [self._router.width(r) for r in range(comm.world_size)]
        in_flight = comm.all_to_all_start(
            pooled.reshape(-1),
            [b * width for b in batches],
            [batch * w for w in widths],
            "output_pooled",
            self.codecs,
        )
        return Pending(
            None,
            lambda: self._output_dist_finish(
                dist_input, in_flight.wait(), widths, hierarchical, replicated
            ),
        )

    def _output_dist_finish(
        self, dist_input, received, widths, hierarchical, replicated
    ) -> KeyedTensor:
        comm, batch, batches = self.comm, dist_input.batch, dist_input.batches
        parts = [
            p.view(batch, w) for p, w in zip(received.split([batch * w for w in widths]), widths)
        ]
        if hierarchical is not None:
            parts.append(self._hierarchical_output(hierarchical, batch, batches))
        if replicated is not None:
            first = sum(batches[: comm.rank])
            parts.append(
                _KeepLocalSamples.apply(replicated, comm, first, batch, batches, self.codecs)
            )
        columns = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if self._col_identity:
            out = columns
        elif self._col_gather is not None:
            out = columns.index_select(1, self._col_gather)
        else:
            out = torch.zeros(
                batch, sum(self.embedding_dims), device=self.device, dtype=columns.dtype
            )
            out = out.index_add(1, self._col_map, columns)
        if dist_input.divisor is not None:
            out = out / dist_input.divisor
        if self.grad_scale != 1.0 and out.requires_grad:
            out = ScaleGrad.apply(out, self.grad_scale)
        return KeyedTensor(self.feature_names, self.embedding_dims, out)

    def extra_repr(self) -> str:
        kinds = sorted({tp.sharding.value for tp in self.plan.tables.values()})
        return (
            f"tables={len(self.tables)}, world={self.comm.world_size}, hosts={self.comm.topology.hosts}, "
            f"sharding={kinds}, backend={self.backend.value}"
        )

    def _hierarchical_output(
        self, pooled: torch.Tensor, batch: int, batches: list[int]
    ) -> torch.Tensor:
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
        summed = gathered.view(per_host, rows[local], width).sum(dim=0)
        widths = [sum(s.width for s in self._router.host_slots(h)) for h in range(topology.hosts)]
        send = [batches[r] * width if r in groups[local] else 0 for r in range(world)]
        recv = [
            batch * widths[topology.host_of(r)] if r % per_host == local else 0
            for r in range(world)
        ]
        received = comm.all_to_all(summed.reshape(-1), send, recv, "output_cross_host", self.codecs)
        blocks = received.split([batch * w for w in widths])
        return torch.cat([b.view(batch, w) for b, w in zip(blocks, widths)], dim=1)


def _shape_of(features: KeyedJaggedTensor) -> tuple[object, ...]:
    """Keys, batch size and id count: what a forward and its prefetched batch share."""
    return (tuple(features.keys()), features.stride(), features.values().numel())


class _KeepLocalSamples(torch.autograd.Function):
    """Forward: this rank's rows of a replica's global-batch output. Backward: the
    gradients of every rank's rows, gathered, so each replica updates as the
    unsharded table would on the global batch."""

    @staticmethod
    def forward(ctx, full, comm: Comm, first, batch, batches, codecs: CommCodecs):
        ctx.comm, ctx.batches, ctx.codecs, ctx.width = comm, batches, codecs, full.shape[1]
        return full[first : first + batch].clone()

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
