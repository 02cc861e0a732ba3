"""Embedding tables larger than memory: a cache of rows in front of the fused kernel.

A cached table keeps all its rows, with their optimizer state, in a backing store
(host memory or an SSD file: ``tier_store.py``, ``ssd_store.py``); the fused kernel
holds only a slot table of ``cache_rows`` rows and runs unchanged on it::

    ids of table t ─► apply id policy ─► TableCache.slots(ids)
                                           hit:  id -> slot map
                                           miss: victim slots (LRU / LFU, not used by
                                                 this batch) written back if dirty,
                                                 the missing rows read from the store
    slots ─► inner EmbeddingBagCollection (slot tables; fused kernel, optimizer in
             backward updates the slots' weights and state in place)

A row's weight and optimizer state move between store and slot as exact float32
copies, and the kernel's arithmetic on a row does not depend on where the row sits,
so training through the cache equals training with the table in memory bit for bit.
Rows a training lookup touched are dirty: eviction and ``flush`` write them back.

Checkpoints see the full tables: ``state_dict`` and ``optimizer_state_dict`` flush and
then name the store's rows under the same keys and shapes as an
``EmbeddingBagCollection``, so a checkpoint loads into either; loading writes the
store and empties the cache.

A kv table (``backing = "kv"``) keys its rows by 64-bit id in an LMDB store and
creates each on first touch (``kv_store.KvStore``), so its ``num_embeddings`` may be
2**40: its map is sorted keys, not an array of the table, and it never appears as a
dense table. ``state_dict`` and ``optimizer_state_dict`` leave it out;
``save_stores`` / ``load_stores`` copy its store into and out of a checkpoint
directory (``train/checkpoint.py`` calls them), and ``table_weights`` refuses it.

Tables whose tier is ``device`` (or whose cache would hold every row: a warning) sit
in the inner collection at full size, as in a plain ``EmbeddingBagCollection``.

A sharded collection (``distributed/lookup.py``) holds its rank's shards in one of
these: each shard table is a ``TableBlock`` of its full table, initialised as that
block and stored in a file of its own (``<table>.shard<k>.tstore``). A kv table's
shard must be the whole table (table-wise): its owner rank keeps the table's own
store (``<table>.kvstore``), the same as one process would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Self

import torch

from towerrec.modules.embedding_bag import (
    EmbeddingBagCollection,
    IdPolicy,
    apply_id_policy,
    check_weighted_pooling,
)
from towerrec.modules.interfaces import FusedEmbeddingCollection, Ready
from towerrec.modules.kernels import Backend
from towerrec.modules.kv_store import KV_SUFFIX, KvStore
from towerrec.modules.ssd_store import SUFFIX, SsdStore
from towerrec.modules.table_cache import CacheStats, TableCache
from towerrec.modules.table_state import (
    check_keys,
    copy_checked,
    load_table_weights,
    other_entries,
    save_table_weights,
    table_key,
)
from towerrec.modules.tables import TableConfig, fill_table_block
from towerrec.modules.tier_store import BackingStore, HostStore, RowLayout, StoreError
from towerrec.modules.tiers import (
    Backing,
    SsdReads,
    TablePlacement,
    TableTiers,
    TierConfig,
    background_on,
    mapped_reads_on,
)
from towerrec.optim.sparse import EmbeddingOptimizer, EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor
from towerrec.utils import parse_enum

__all__ = ["CachedEmbeddingBagCollection", "TableBlock", "build_store"]


@dataclass(frozen=True)
class TableBlock:
    """Rows ``rows`` x columns ``cols`` of ``table``: what a shard table holds."""

    table: TableConfig
    rows: tuple[int, int]
    cols: tuple[int, int]
    store_name: str


class CachedEmbeddingBagCollection(FusedEmbeddingCollection):
    """An ``EmbeddingBagCollection`` whose cached tables live in backing stores (module doc).

    ``placements``: each table's, as ``TableTiers.place`` decided them
    (``build_embedding_collection`` does); without them, they are decided here from
    ``tiers``, which maps table names to their tier, the others taking ``default``.
    A ``CachingCollection`` (``modules/interfaces.py``).
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: EmbeddingOptimizerConfig | None = None,
        *,
        tiers: Mapping[str, TierConfig] | None = None,
        default: TierConfig | None = None,
        placements: Mapping[str, TablePlacement] | None = None,
        backend: Backend | str = Backend.AUTO,
        device: torch.device | str | None = None,
        id_policy: IdPolicy | str = IdPolicy.ERROR,
        seed: int = 0,
        blocks: Mapping[str, TableBlock] | None = None,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.seed = seed
        self.blocks = dict(blocks or {})
        self.id_policy = parse_enum(IdPolicy, id_policy, "embedding id_policy")
        self._inner: EmbeddingBagCollection
        if placements is None:
            placements = TableTiers(default or TierConfig(), dict(tiers or {})).place_tables(
                self.tables
            )
        self.placements = {t.name: placements[t.name] for t in self.tables}
        self.cache_rows = {n: p.cache_rows for n, p in self.placements.items() if p.is_cached}
        dense_adam = optimizer is not None and optimizer.kind is EmbeddingOptimizer.DENSE_ADAM
        if self.cache_rows and dense_adam:
            raise ValueError(
                f"embedding optimizer 'dense_adam' moves every row of a table every step, but "
                f"table(s) {sorted(self.cache_rows)} keep most rows outside memory "
                "(memory = 'cached'): use 'adam' (the rows a batch touches), or keep the "
                "tables in memory (memory = 'device')"
            )
        inner_tables = [
            replace(t, num_embeddings=self.cache_rows[t.name]) if t.name in self.cache_rows else t
            for t in self.tables
        ]
        # A plain attribute, not a submodule: this collection is the fused one that
        # checkpoints and the trainer find (``fused_embedding_modules``).
        inner = EmbeddingBagCollection(
            inner_tables, optimizer, backend=backend, device=device, seed=seed, materialize=False
        )
        inner.materialize(init=False)  # reset_parameters below fills what needs it
        object.__setattr__(self, "_inner", inner)  # bypasses Module's submodule registration
        self.optimizer = self._inner.optimizer
        self.feature_names = self._inner.feature_names
        self.embedding_dims = self._inner.embedding_dims
        per_feature = {f: t.num_embeddings for t in self.tables for f in t.feature_names}
        self._rows_per_feature = torch.tensor(
            [per_feature[f] for f in self.feature_names], dtype=torch.int64
        )
        self.caches: dict[str, TableCache] = {}
        layouts = {}
        for table in self.tables:
            if table.name not in self.cache_rows:
                continue
            state_shapes = self.optimizer.kind.state_shapes(1, table.embedding_dim)
            layouts[table.name] = RowLayout(
                table.name,
                table.num_embeddings,
                table.embedding_dim,
                tuple((n, s[1] if len(s) > 1 else 1) for n, s in state_shapes.items() if s),
            )
        mapped = self._mapped_reads(layouts)
        for table in self.tables:
            if table.name not in self.cache_rows:
                continue
            layout = layouts[table.name]
            tier = self.placements[table.name].tier
            kv = self.placements[table.name].is_kv
            block = self.blocks.get(table.name)
            if kv and block is not None and not _whole(block):
                raise StoreError(
                    f"table {table.name!r} is a kv table (embedding.backing = 'kv'), which "
                    f"shards table-wise only, but this shard holds rows {block.rows} x columns "
                    f"{block.cols} of it; plan it 'table_wise', or use backing = 'ssd' to "
                    "split it"
                )
            # A kv table's shard is the whole table: its store is the table's own
            # (``<table>.kvstore``), opened by its owner rank only.
            store_name = None if block is None or kv else block.store_name
            self.caches[table.name] = TableCache(
                table,
                self.cache_rows[table.name],
                tier.cache_policy,
                build_store(
                    layout,
                    tier,
                    store_name,
                    table=table if block is None else block.table,
                    seed=seed,
                    device=self._inner.device,
                    mapped_reads=mapped.get(table.name, False),
                ),
                weight=partial(self._slot_weight, table.name),
                states=partial(self._slot_states, table.name),
                sparse_ids=kv,
                on_device=tier.cache_maps.on_device(self._inner.device.type),
                device=self._inner.device,
            )
        index = {f: i for i, f in enumerate(self.feature_names)}
        self._cached_features = {
            t.name: [index[f] for f in t.feature_names]
            for t in self.tables
            if t.name in self.caches
        }
        self._prefetcher: ThreadPoolExecutor | None = None
        self._keys = itertools.count()
        self._next_key: int | None = None
        self._queued: dict[int, dict[str, torch.Tensor]] = {}  # ids of batches to read ahead
        self._reading: int | None = None  # the key read ahead whose lookup has not come
        self.reset_parameters()

    def _mapped_reads(self, layouts: Mapping[str, RowLayout]) -> dict[str, bool]:
        """Whether each SSD-backed table's store reads through its file's mapping
        (``embedding.ssd_reads``): the settings of ``auto`` decided once, for all of this
        collection's store files together (``mapped_reads_on``)."""
        ssd = {
            name: self.placements[name].tier
            for name in layouts
            if self.placements[name].tier.backing is Backing.SSD
        }
        automatic = [n for n, tier in ssd.items() if tier.ssd_reads is SsdReads.AUTO]
        auto = bool(automatic) and mapped_reads_on(sum(layouts[n].rows_bytes for n in automatic))
        return {
            n: auto if tier.ssd_reads is SsdReads.AUTO else tier.ssd_reads is SsdReads.MAPPED
            for n, tier in ssd.items()
        }

    # ------------------------------------------------------------ interface
    @property
    def backend(self) -> Backend:
        return self._inner.backend

    @property
    def device(self) -> torch.device:
        return self._inner.device

    @property
    def num_embedding_parameters(self) -> int:
        return sum(t.num_parameters for t in self.tables)

    def set_learning_rate(self, lr: float) -> None:
        self._inner.set_learning_rate(lr)

    def describe(self) -> list[dict[str, Any]]:
        out = super().describe()
        for row in out:
            cache = self.caches.get(row["table"])
            if cache is not None:
                row["memory"] = f"cached {cache.cache_rows} rows, {type(cache.store).__name__}"
        return out

    @property
    def cached_tables(self) -> list[str]:
        return list(self.caches)

    def read_rows_ahead(self, on: bool) -> bool:
        """Whether there are cached tables whose rows ``prefetch`` reads ahead: the
        pipeline that calls it runs when ``on`` (the trainer's choice)."""
        return bool(self.caches)

    @property
    def kv_stores(self) -> dict[str, KvStore]:
        """``{table: store}`` of the kv tables (module doc)."""
        return {n: c.store for n, c in self.caches.items() if isinstance(c.store, KvStore)}

    def cache_stats(self) -> dict[str, CacheStats]:
        return {name: cache.stats for name, cache in self.caches.items()}

    def _slot_weight(self, table: str) -> torch.Tensor:
        return self._inner.table_views(table)[0]  # (one table's slices: cheap)

    def _slot_states(self, table: str) -> dict[str, torch.Tensor]:
        return self._inner.table_views(table)[1]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from ``seed`` (the same rows as an ``EmbeddingBagCollection``;
        a block's, those of its full table). A cached table's rows go to its store; its
        slots are empty until rows are read into them, so they are zeroed, not drawn (a
        draw of every slot took seconds per million slots)."""
        self._inner.zero_optimizer_states()
        weights = self._inner.table_weights()
        for table in self.tables:
            cache, block = self.caches.get(table.name), self.blocks.get(table.name)
            if cache is None:
                if block is not None:
                    fill_table_block(
                        weights[table.name], block.table, self.seed, block.rows, block.cols
                    )
                else:
                    fill_table_block(weights[table.name], table, self.seed)
                continue
            weights[table.name].zero_()

            def fill(out: torch.Tensor, lo: int, hi: int, table: TableConfig = table) -> None:
                block = self.blocks.get(table.name)
                if block is None:
                    fill_table_block(out, table, self.seed, rows=(lo, hi))
                else:
                    r0 = block.rows[0]
                    fill_table_block(out, block.table, self.seed, (r0 + lo, r0 + hi), block.cols)

            cache.store.initialize(fill)
            cache.invalidate()

    @torch.no_grad()
    def flush(self) -> None:
        """Write every dirty cached row back to its store."""
        for cache in self.caches.values():
            cache.flush()

    # -------------------------------------------------------------- forward
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if features.keys() != self.feature_names:
            features = features.select(self.feature_names)
        check_weighted_pooling(features, self.tables)
        values = apply_id_policy(
            features, self._rows_per_feature.to(features.values().device), self.id_policy
        )
        if self.caches:
            ids = _BatchIds(features, values)
            batch = features.stride()
            if not torch.is_grad_enabled() and batch > 1 and not self._fits(ids):
                # A lookup that trains nothing (evaluation) may be split by samples until
                # each part's rows fit the caches; a training batch must fit whole.
                half = batch // 2
                halves = ((0, half), (half, batch))
                parts = [self(_sample_slice(features, values, a, b)) for a, b in halves]
                return KeyedTensor(
                    self.feature_names,
                    self.embedding_dims,
                    torch.cat([p.values() for p in parts]),
                )
            values = self._to_slots(ids)
        slotted = KeyedJaggedTensor(
            features.keys(),
            values,
            features.lengths(),
            features.weights_or_none(),
            offsets=features.offsets(),
            validate=False,
        )
        pooled: KeyedTensor = self._inner(slotted)
        return pooled

    def forward_start(self, features: KeyedJaggedTensor) -> Ready:
        return Ready(self(features))

    def prefetch(self, features: KeyedJaggedTensor) -> int:
        """Read a later batch's missing rows in a background thread (the
        ``PrefetchingCollection`` of ``train/pipeline.py``); returns its key. The read
        starts once the lookups before that batch's are done (``_read_ahead``)."""
        key = next(self._keys)
        if not self.caches:
            return key
        if features.keys() != self.feature_names:
            features = features.select(self.feature_names)
        values = apply_id_policy(
            features, self._rows_per_feature.to(features.values().device), self.id_policy
        )
        ids = _BatchIds(features, values)
        self._queued[key] = {name: self._table_ids(name, ids)[0] for name in self.caches}
        self._read_ahead()
        return key

    def _read_ahead(self) -> None:
        """Start the background read of the oldest queued batch, unless a batch read ahead
        still waits for its lookup: a batch's misses are known once the lookup before it
        has run, so each read starts after it (and runs during the rest of that step)."""
        if self._reading is not None or not self._queued:
            return
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="towerrec-prefetch")
        key = min(self._queued)
        for name, ids in self._queued.pop(key).items():
            self.caches[name].prefetch(key, ids, self._prefetcher)
        self._reading = key

    def _looked_up(self, key: int | None) -> None:
        """A lookup took batch ``key``: earlier batches' reads are dropped (their lookups
        never came), and the next queued batch's read starts."""
        if key is not None:
            self._queued = {k: ids for k, ids in self._queued.items() if k > key}
            if self._reading is not None and self._reading <= key:
                self._reading = None
        self._read_ahead()

    def use_prefetched(self, key: int) -> None:
        """The next forward's batch is the one prefetched under ``key``."""
        self._next_key = key

    def _table_ids(self, name: str, ids: _BatchIds) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The ids of cached table ``name`` (int64, where its cache's bookkeeping runs) and
        their spans in ``ids.values``."""
        spans = [ids.span(f) for f in self._cached_features[name]]
        values = ids.on(self.caches[name].device)
        return torch.cat([values[lo:hi] for lo, hi in spans]).long(), spans

    def _fits(self, ids: _BatchIds) -> bool:
        return all(
            self._table_ids(name, ids)[0].unique().numel() <= cache.cache_rows
            for name, cache in self.caches.items()
        )

    def _to_slots(self, ids: _BatchIds) -> torch.Tensor:
        """The batch's ids with each cached table's replaced by their cache slots (on the
        device of the ids, which host-bookkept caches' slots are copied to)."""
        training = torch.is_grad_enabled()
        key, self._next_key = self._next_key, None
        out = ids.values.clone()
        for name, cache in self.caches.items():
            table_ids, spans = self._table_ids(name, ids)
            slots = cache.slots(table_ids, training, key).to(out.device, out.dtype)
            start = 0
            for lo, hi in spans:
                out[lo:hi] = slots[start : start + hi - lo]
                start += hi - lo
        self._looked_up(key)
        return out

    # ------------------------------------------------------- checkpoints
    def table_weights(self) -> dict[str, torch.Tensor]:
        """``{table: weight[rows, dim]}`` of every table, cached ones from their stores
        (after a flush); in-place writes to a cached table's view reach only the store.
        A kv table has no such array: refused, naming it."""
        for name, store in self.kv_stores.items():
            raise StoreError(
                f"table {name!r} is a kv table ({store.layout.num_embeddings} rows keyed by "
                "id, created on first touch): its weights are not one array; this feature "
                "(export, dense weight access) needs embedding.backing = 'host' or 'ssd' for it"
            )
        return self.dense_table_weights()

    def dense_table_weights(self) -> dict[str, torch.Tensor]:
        """``table_weights`` of every table but the kv ones."""
        self.flush()
        weights = self._inner.table_weights()
        kv = self.kv_stores
        for name, cache in self.caches.items():
            if name not in kv:
                weights[name] = cache.store.weight()
        return {t.name: weights[t.name] for t in self.tables if t.name not in kv}

    def optimizer_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The fused optimizer's state, cached tables' from their stores; a kv table's
        state travels with its rows in its store (``save_stores``)."""
        self.flush()
        state = self._inner.optimizer_state_dict(prefix)
        kv = self.kv_stores
        for name, store in kv.items():
            for state_name in store.layout.state_columns():
                del state[table_key(prefix, name, state_name)]  # the slots'

        for name, cache in self.caches.items():
            if name in kv:
                continue
            for key, value in cache.store.states().items():
                state[table_key(prefix, name, key)] = value
        return state

    def save_stores(self, directory: str | Path) -> None:
        """Flush, then copy each kv table's store into ``directory/<table>`` (a
        consistent compacted LMDB copy with a CRC32, ``KvStore.save_copy``)."""
        self.flush()
        for name, store in self.kv_stores.items():
            store.save_copy(Path(directory) / name)

    def load_stores(self, directory: str | Path) -> None:
        """Replace each kv table's store by its copy in ``directory/<table>`` (checked:
        header and CRC32) and empty the caches."""
        self._invalidate()
        for name, store in self.kv_stores.items():
            store.load_copy(Path(directory) / name)

    @torch.no_grad()
    def load_optimizer_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "") -> None:
        expected = self.optimizer_state_dict(prefix)  # flushes: slots and stores agree
        check_keys(expected, state, "embedding optimizer state")
        for key, target in expected.items():  # views: the stores' rows, the kernels' state
            copy_checked(target, state[key], key)
        self._invalidate()

    def invalidate(self) -> None:
        """Empty the caches (after the stores were written from outside, e.g. a sharded
        checkpoint's load into the views of ``table_weights``)."""
        self._invalidate()

    def _invalidate(self) -> None:
        for cache in self.caches.values():
            cache.invalidate()
        self._queued.clear()
        self._reading = None

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        save_table_weights(destination, prefix, self.dense_table_weights())

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            other_entries(state_dict, prefix),
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )
        weights = self.dense_table_weights()  # flushes first
        load_table_weights(weights, state_dict, prefix, missing_keys, unexpected_keys, error_msgs)
        self._invalidate()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        self.flush()
        self._inner._apply(fn, recurse)  # the slot tables move, the stores stay
        device = self._inner.device
        for name, cache in self.caches.items():  # the maps go where tier.cache_maps says
            cache.place(self.placements[name].tier.cache_maps.on_device(device.type), device)
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves Module._apply untyped

    def extra_repr(self) -> str:
        cached = ", ".join(f"{n}: {c.cache_rows} slots" for n, c in self.caches.items())
        return f"{self._inner.extra_repr()}, cached=[{cached}]"


class _BatchIds:
    """A batch's (policy-applied) ids where they are, and each feature's span (the counts
    per feature: one small copy from an accelerator). Caches whose bookkeeping runs in
    host memory share one host copy of the ids per lookup; the others take them where
    they are, so a batch's ids never leave the GPU for them."""

    def __init__(self, features: KeyedJaggedTensor, values: torch.Tensor) -> None:
        self.values = values
        self.offsets = features.offset_per_key()
        self._copies: dict[torch.device, torch.Tensor] = {values.device: values}

    def on(self, device: torch.device) -> torch.Tensor:
        """The ids on ``device`` (copied once)."""
        if device not in self._copies:
            self._copies[device] = self.values.to(device)
        return self._copies[device]

    def span(self, feature: int) -> tuple[int, int]:
        """``[lo, hi)`` of feature number ``feature``'s ids in ``values``."""
        return self.offsets[feature], self.offsets[feature + 1]


def build_store(
    layout: RowLayout,
    tier: TierConfig,
    name: str | None = None,
    table: TableConfig | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    mapped_reads: bool = False,
) -> BackingStore:
    """The backing store ``tier`` asks for (one file per table: ``<path>/<name>.tstore``,
    ``name`` defaulting to the table's; a shard's store names its shard). A kv store
    needs ``table`` and ``seed``: it initialises rows from them on first touch. An SSD
    store writes behind (``SsdStore.write_behind``) as ``tier.write_behind`` says
    (``auto``: where the step runs on ``device``, an accelerator, or the process has a core
    beyond its torch threads: ``background_on``) and reads and writes through its file's
    mapping when ``mapped_reads`` (``SsdStore``)."""
    if tier.backing is Backing.HOST:
        return HostStore(layout)
    if tier.backing is Backing.KV:
        if table is None:
            raise ValueError(f"table {layout.table!r}: a kv store needs its TableConfig")
        return KvStore(
            layout, Path(tier.backing_path) / f"{name or layout.table}{KV_SUFFIX}", table, seed
        )
    store = SsdStore(
        layout,
        Path(tier.backing_path) / f"{name or layout.table}{SUFFIX}",
        mapped_reads=mapped_reads,
    )
    if background_on(tier.write_behind, "embedding.write_behind", device=device):
        store.write_behind()
    return store


def _whole(block: TableBlock) -> bool:
    """Whether ``block`` is all of its table (a table-wise shard)."""
    table = block.table
    return block.rows == (0, table.num_embeddings) and block.cols == (0, table.embedding_dim)


def _sample_slice(
    features: KeyedJaggedTensor, values: torch.Tensor, start: int, end: int
) -> KeyedJaggedTensor:
    """Samples ``start:end`` of ``features`` (with ``values`` for its ids)."""
    batch, offsets = features.stride(), features.offsets()
    keys = features.keys()
    lengths = features.lengths().view(len(keys), batch)[:, start:end].reshape(-1)
    spans = [
        (int(offsets[f * batch + start]), int(offsets[f * batch + end])) for f in range(len(keys))
    ]
    weights = features.weights_or_none()
    return KeyedJaggedTensor(
        keys,
        torch.cat([values[lo:hi] for lo, hi in spans]),
        lengths,
        None if weights is None else torch.cat([weights[lo:hi] for lo, hi in spans]),
        validate=False,
    )
