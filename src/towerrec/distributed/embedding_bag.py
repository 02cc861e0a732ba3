"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection split over ranks by a plan.

::

    local batch KeyedJaggedTensor (B samples)
      │ input_dist   ids checked (id policy), routed to the shards that own them:
      │              one all-to-all of lengths + ids + weights once sizes settle
      │              (sized_exchange.py); data-parallel features: the global
      │              batch's ids gathered in the same message
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
lookup's backward (``column_sync.py``).

Cached shards (``memory = "cached"``) read their misses ahead under the pipeline
(``train/pipeline.py``): a training forward that takes a prefetched input_dist,
once its lookup has run and its output all-to-all is started, waits for the
next prefetched batch's input_dist (its all-to-alls were started before this
step began) and hands that batch's ids of this rank's shards to the cache's
background prefetch (``CachedEmbeddingBagCollection.prefetch``); the next
forward's lookup takes the rows read. The reads overlap the rest of the step
(dense layers, output all-to-all, backward, optimizer); a row written back
after its read began is read again (``table_cache.py``), so the arithmetic is
unchanged. ``prefetch_rows = False`` turns this off (``embedding.prefetch``).

The three stages are three files: ``input_dist.py`` (``InputDist``, the
``Router``), ``lookup.py`` (this rank's shard kernels and replicas) and
``output_dist.py`` (``OutputDist``); what each sharding type means for them is
``towerrec.sharding``. This class holds them together with the state dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from pathlib import Path

import torch

from towerrec.distributed.column_sync import ColumnRowwiseSync
from towerrec.distributed.comm import Comm, CommCodecs, CommStats, Pending
from towerrec.distributed.id_wire import IdWire
from towerrec.distributed.input_dist import DistInput, InputDist, Router
from towerrec.distributed.lookup import (
    Local,
    ShardView,
    build_local,
    build_replica,
    cached_shard_tables,
    kernel_steps,
    kv_shard_tables,
    replica_views,
    shard_views,
)
from towerrec.distributed.output_dist import OutputDist, ScaleGrad
from towerrec.distributed.state import load_tensor, state_tensors
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.interfaces import CachingCollection, FusedEmbeddingCollection
from towerrec.modules.kv_store import KvStore
from towerrec.modules.table_cache import CacheStats
from towerrec.sharding import ShardingPlan, strategy_for
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor

__all__ = ["DistInput", "ScaleGrad", "ShardView", "ShardedEmbeddingBagCollection"]


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
    ``id_wire`` is the encoding of the ids on the wire (``id_wire.py``; default:
    narrow integer types, deduplicated).

    A ``PooledEmbeddingCollection``, a ``FusedEmbeddingCollection``, a
    ``PrefetchingCollection`` and a ``CachingCollection`` (``modules/interfaces.py``;
    its cached tables are those of its rank's shards, ``cached_shards``).
    """

    _local: Local | None
    _cached_shards: CachingCollection | None
    _replica: EmbeddingBagCollection | None

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        plan: ShardingPlan,
        comm: Comm,
        *,
        codecs: CommCodecs | None = None,
        grad_scale: float = 1.0,
        id_wire: IdWire | None = None,
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
        # The tables cached on some rank (the same set on every rank); refuses what
        # cannot be cached.
        self.cached_tables = cached_shard_tables(ebc, ebc.tables, plan)
        # Kv tables (table-wise, whole on their owner): no dense state; their stores are
        # saved whole by their owners (``train/checkpoint.py``).
        self.kv_tables = kv_shard_tables(ebc, self.cached_tables)
        self.prefetch_rows = True  # read the next prefetched batch's misses ahead (module doc)
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
        replicated = {n for n, tp in plan.tables.items() if strategy_for(tp.sharding).replicated}
        sharded_tables = [t for t in self.tables if t.name not in replicated]
        replicated_tables = [t for t in self.tables if t.name in replicated]
        self._router = Router(sharded_tables, plan, topology)
        # Plain attributes, not submodules: the shards' state is ours to name (see state.py).
        local = build_local(ebc, sharded_tables, plan, self._router.slots[comm.rank], comm.rank)
        replica = build_replica(ebc, replicated_tables)
        object.__setattr__(self, "_local", local)
        cached_shards = local if isinstance(local, CachingCollection) else None
        object.__setattr__(self, "_cached_shards", cached_shards)
        object.__setattr__(self, "_replica", replica)
        split = ColumnRowwiseSync.split_tables(plan, sharded_tables, self.optimizer.kind)
        self._rowwise = ColumnRowwiseSync(comm, plan, split, self.device) if split else None
        if self._rowwise is not None and isinstance(local, EmbeddingBagCollection):
            local.defer_rowwise({t.name for t in split}, self._rowwise)
        self._input = InputDist(
            self._router,
            comm,
            self.tables,
            replicated_tables,
            self.feature_names,
            self.embedding_dims,
            ebc._rows_per_feature,
            self.id_policy,
            self.device,
            id_wire,
        )
        self._output = OutputDist(
            self._router,
            comm,
            self.feature_names,
            self.embedding_dims,
            list(zip(replica.feature_names, replica.embedding_dims)) if replica else [],
            codecs=self.codecs,
            grad_scale=grad_scale,
            device=self.device,
        )
        # Prefetched input_dists by key, and the key the next forward takes (if any).
        self._prefetched: dict[int, _Prefetched] = {}
        self._prefetch_keys = count()
        self._next_prefetched: int | None = None

    # ----------------------------------------------------------- accessors
    @property
    def num_embedding_parameters(self) -> int:
        return sum(t.num_parameters for t in self.tables)

    def shard_views(self) -> list[ShardView]:
        """Every shard stored on this rank (data-parallel replicas as full-table shards)."""
        rank = self.comm.rank
        return [*shard_views(self._local, self.plan, rank), *replica_views(self._replica, rank)]

    def kernel_steps(self) -> list[torch.Tensor]:
        """The step tensors of this rank's kernels (shards, kv tables' included, and
        replicas); empty when it stores nothing."""
        return kernel_steps(self._local, self._replica)

    @property
    def cached_shards(self) -> CachingCollection | None:
        """The collection of this rank's shards when some run cached (their caches and
        stores), else None."""
        return self._cached_shards

    def read_rows_ahead(self, on: bool) -> bool:
        """Read the next prefetched batch's missing rows of this rank's cached shards
        ahead (module doc) when ``on``; returns whether some table runs cached, on any
        rank (the pipeline runs on every rank or none)."""
        self.prefetch_rows = on
        return bool(self.cached_tables)

    def cache_stats(self) -> dict[str, CacheStats]:
        """The counts of this rank's cached shards, by table (``CacheStats``)."""
        return {} if self._cached_shards is None else self._cached_shards.cache_stats()

    @property
    def kv_stores(self) -> dict[str, KvStore]:
        """The stores of the kv tables this rank owns (a kv table is whole on one rank)."""
        return {} if self._cached_shards is None else dict(self._cached_shards.kv_stores)

    def save_stores(self, directory: str | Path) -> None:
        """Save this rank's kv tables' stores (``CachedEmbeddingBagCollection``)."""
        if self._cached_shards is not None:
            self._cached_shards.save_stores(directory)

    def load_stores(self, directory: str | Path) -> None:
        """Load this rank's kv tables' stores (``CachedEmbeddingBagCollection``)."""
        if self._cached_shards is not None:
            self._cached_shards.load_stores(directory)

    def invalidate(self) -> None:
        """Empty the caches of this rank's cached shards."""
        if self._cached_shards is not None:
            self._cached_shards.invalidate()

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
        self._loaded()

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
        self._loaded()

    def _loaded(self) -> None:
        """Cached shards were loaded into their stores: their caches hold stale rows."""
        self.invalidate()

    # ------------------------------------------------------------- forward
    def input_dist(self, features: KeyedJaggedTensor, settle: bool = False) -> Pending:
        """Start sending this batch's ids to their shards; ``.wait()`` gives a ``DistInput``
        (``input_dist.py``; ``settle``: sizes read before this returns, for a prefetch)."""
        return self._input.start(features, settle)

    def prefetch(self, features: KeyedJaggedTensor) -> int:
        """Start ``input_dist`` of a batch that a later forward will take; returns its key
        (see ``use_prefetched``). Every rank must prefetch the same sequence of batches."""
        held = CommStats()  # counted when the batch is trained, not while it waits
        with self.comm.recording_into(held):
            pending = self.input_dist(features, settle=True)
        key = next(self._prefetch_keys)
        self._prefetched[key] = _Prefetched(pending, held, _shape_of(features))
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
        rows_key = None
        if key is not None:
            prefetched = self._prefetched.pop(key)
            if prefetched.shape != _shape_of(features):
                raise ValueError(
                    f"the forward's batch (keys, batch size, ids: {_shape_of(features)}) is not "
                    f"the one prefetched under key {key} ({prefetched.shape}): prefetch and "
                    "forward the same batches in the same order"
                )
            self.comm.stats.merge(prefetched.held)
            pending, rows_key = prefetched.pending, prefetched.rows_key
        else:
            pending = self.input_dist(features)
        handle = self.output_dist_start(self.lookup(pending.wait(), rows_key))
        if key is not None and torch.is_grad_enabled():
            self._prefetch_next_rows()  # a training step of the pipeline: read ahead
        return handle

    def _prefetch_next_rows(self) -> None:
        """Start the cache's background read of the next prefetched batch's missing rows
        of this rank's shards (module doc); waits for that batch's input_dist."""
        local = self._cached_shards
        if not self.prefetch_rows or local is None:
            return
        if not local.cached_tables or not self._prefetched:
            return
        upcoming = self._prefetched[min(self._prefetched)]  # keys count up: the next batch
        if upcoming.rows_key is not None:
            return
        dist_input: DistInput = upcoming.pending.wait()  # kept: its forward takes it as is
        if dist_input.local is not None:
            upcoming.rows_key = local.prefetch(dist_input.local)

    def lookup(
        self, dist_input: DistInput, rows_key: int | None = None
    ) -> tuple[DistInput, torch.Tensor, torch.Tensor | None]:
        """Pool this rank's shards: ``[sum_r B_r, W_rank]`` and replicas ``[sum_r B_r, W_dp]``;
        cached shards take the rows read ahead under ``rows_key`` (``_prefetch_next_rows``)."""
        total = sum(dist_input.batches)
        fence = self._rowwise.start() if self._rowwise is not None else None
        if self._local is not None and dist_input.local is not None:
            if rows_key is not None and self._cached_shards is not None:
                self._cached_shards.use_prefetched(rows_key)
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
        ``output_dist`` (``output_dist.py``; the hierarchical and replicated parts run there)."""
        dist_input, pooled, replicated = looked_up
        return self._output.start(dist_input, pooled, replicated)

    def extra_repr(self) -> str:
        kinds = sorted({tp.sharding.value for tp in self.plan.tables.values()})
        return (
            f"tables={len(self.tables)}, world={self.comm.world_size}, hosts={self.comm.topology.hosts}, "
            f"sharding={kinds}, backend={self.backend.value}"
        )


@dataclass
class _Prefetched:
    """A prefetched input_dist: in flight (or finished), its bytes held until its batch
    is trained, the batch's shape, and the key of its cached rows read ahead (if any)."""

    pending: Pending
    held: CommStats
    shape: tuple[object, ...]
    rows_key: int | None = None


def _shape_of(features: KeyedJaggedTensor) -> tuple[object, ...]:
    """Keys, batch size and id count: what a forward and its prefetched batch share."""
    return (tuple(features.keys()), features.stride(), features.values().numel())
