"""Memory-efficient embedding collections: hashed, compositional and mixed-dimension tables.

Same interface as ``EmbeddingBagCollection`` (``KeyedJaggedTensor`` in,
``KeyedTensor [B, sum(D_f)]`` out), so every model takes either. Each logical
table becomes one or more smaller *physical* tables, all looked up in one
inner ``EmbeddingBagCollection`` (fused kernels, optimizer in backward)::

    ids of feature f ─► id map ─► physical ids ─┐
                                                ├─► inner EmbeddingBagCollection
                                                │    (one fused call for all tables)
    pooled physical vectors [B, d_j] ◄──────────┘
        ─► combine: full / hash   e_0
                    qr  mult      e_0 ⊙ e_1 ⊙ ... ⊙ e_{P-1}
                        add       e_0 + ... + e_{P-1}
                        concat    [e_0, ..., e_{P-1}]        (D split over the P tables)
                    md            e_0 W_f                    W_f [d_f, D] (when d_f < D)
        ─► KeyedTensor [B, T*D]

The collection-wide ``CompactConfig`` can be overridden per table
(``CompactConfig.tables``, ``[embedding.tables.<name>]`` in a run's config):
kind, compression and the partition settings, e.g. ``cat_3`` as QR 8x while
the others stay full; or ``dim``, a full table stored narrower and projected to
the common dim as md tables are (what ``towerrec nas search --space emb_dim`` writes). A table named there is stored by its own settings
whatever its size (``row_threshold`` picks among the others). Mixed
dimensions are collection-wide only: a table's dim comes from the popularity
of all tables together.

Pooling commutes with add, concat and the projection, so those combine pooled
bags. It does not commute with mult: a multi-hot (or weighted) batch is then
looked up one id per bag (``[N_max, ...]``), combined per id and pooled here.

Init keeps combined vectors at a full table's scale s (``TableConfig.scale``):
add tables start at s / sqrt(P), concat and hash at s, mult multiplies e_0 (at
s) by factors 1 + U(-s, s), and the md projection is N(0, 1 / d_f), which
preserves the variance of e_0.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn

from towerrec.memory import physical_memory_bytes
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.compact_config import (
    Combine,
    CompactConfig,
    EmbeddingKind,
    TableStorageConfig,
)
from towerrec.modules.compositional import (
    PartitionScheme,
    hash_rows,
    partition_ids,
    partition_sizes,
)
from towerrec.modules.embedding_bag import (
    EmbeddingBagCollection,
    IdPolicy,
    apply_id_policy,
    check_weighted_pooling,
)
from towerrec.modules.interfaces import Ready
from towerrec.modules.kernels import Backend, resolve_backend
from towerrec.modules.mixed_dim import mixed_dimensions
from towerrec.modules.tables import Pooling, TableConfig
from towerrec.modules.tiers import TableTiers, TierConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor
from towerrec.utils import parse_enum, stable_seed

__all__ = [
    "Combine",
    "CompactConfig",
    "CompactEmbeddingCollection",
    "EmbeddingKind",
    "TableStorageConfig",
    "build_embedding_collection",
]


@dataclass
class _Plan:
    """One logical table: its physical tables and how their vectors combine."""

    table: TableConfig
    kind: EmbeddingKind
    parts: list[TableConfig]
    sizes: list[int] = field(default_factory=list)  # qr: partition sizes; hash: [m]
    operation: Combine | None = None
    scheme: PartitionScheme | None = None

    def physical_name(self, feature: str, part: int) -> str:
        return feature if len(self.parts) == 1 else f"{feature}_part{part}"

    def map_ids(self, ids: torch.Tensor) -> list[torch.Tensor]:
        if self.kind is EmbeddingKind.HASH:
            return [torch.remainder(ids, self.sizes[0])]
        if self.kind is EmbeddingKind.QR:
            assert self.scheme is not None  # QR plans are built with their scheme
            return partition_ids(ids, self.scheme, self.sizes)
        return [ids]


def _split_dim(dim: int, parts: int) -> list[int]:
    if dim < parts:
        raise ValueError(
            f"concat needs embedding_dim >= qr_partitions, got {dim} < {parts}; "
            "use qr_operation = 'mult' or 'add', or fewer partitions"
        )
    unit = 4 if dim % 4 == 0 and dim >= 4 * parts else 1  # FBGEMM wants multiples of 4
    blocks = dim // unit
    return [unit * (blocks // parts + (1 if j < blocks % parts else 0)) for j in range(parts)]


def _plans(tables: list[TableConfig], collection: CompactConfig) -> list[_Plan]:
    collection.check_table_names(tables)
    md_dims = None
    config = collection
    if config.kind is EmbeddingKind.MD:
        md_dims = mixed_dimensions(
            [t.num_embeddings for t in tables],
            config.md_alpha,
            max(t.embedding_dim for t in tables),
            budget=config.md_budget,
            min_dim=config.md_min_dim,
            round_to=config.md_round_to,
        )
        md_dims = [min(d, t.embedding_dim) for d, t in zip(md_dims, tables)]
    plans = []
    for i, t in enumerate(tables):
        s = t.scale
        config = collection.for_table(t.name)
        compress = t.num_embeddings > config.row_threshold
        if config.dim and config.dim > t.embedding_dim:
            raise ValueError(
                f"embedding.tables.{t.name}.dim = {config.dim} is wider than the model's "
                f"embedding_dim {t.embedding_dim}; a table is stored at most that wide"
            )
        if config.dim and config.dim < t.embedding_dim:  # narrow, projected as md is
            part = replace(t, embedding_dim=config.dim, init_scale=s)
            plans.append(_Plan(t, EmbeddingKind.MD, [part]))
        elif config.kind is EmbeddingKind.MD:
            assert md_dims is not None  # md is set for the whole collection, never per table
            part = replace(t, embedding_dim=md_dims[i], init_scale=s)
            plans.append(_Plan(t, EmbeddingKind.MD, [part]))
        elif config.kind is EmbeddingKind.HASH and compress:
            m = hash_rows(t.num_embeddings, config.compression)
            plans.append(_Plan(t, config.kind, [replace(t, num_embeddings=m, init_scale=s)], [m]))
        elif config.kind is EmbeddingKind.QR and compress:
            p = config.num_partitions
            sizes = partition_sizes(config.scheme, t.num_embeddings, config.compression, p)
            if config.operation is Combine.CONCAT:
                dims, scales = _split_dim(t.embedding_dim, p), [s] * p
            elif config.operation is Combine.ADD:
                dims, scales = [t.embedding_dim] * p, [s / math.sqrt(p)] * p
            else:
                dims, scales = [t.embedding_dim] * p, [s] * p
            parts = [
                replace(
                    t,
                    name=f"{t.name}_part{j}",
                    num_embeddings=rows,
                    embedding_dim=dim,
                    feature_names=tuple(f"{f}_part{j}" for f in t.feature_names),
                    init_scale=scale,
                )
                for j, (rows, dim, scale) in enumerate(zip(sizes, dims, scales))
            ]
            plans.append(_Plan(t, config.kind, parts, sizes, config.operation, config.scheme))
        else:
            plans.append(_Plan(t, EmbeddingKind.FULL, [t]))
    return plans


class CompactEmbeddingCollection(nn.Module):
    """Hashed, compositional or mixed-dimension tables behind the collection interface
    (a ``PooledEmbeddingCollection``, ``modules/interfaces.py``); its inner collection is
    the fused one."""

    _rows_per_feature: torch.Tensor

    def __init__(
        self,
        tables: list[TableConfig],
        config: CompactConfig,
        optimizer: EmbeddingOptimizerConfig | None = None,
        *,
        backend: Backend | str = Backend.AUTO,
        device: torch.device | str | None = None,
        id_policy: IdPolicy | str = IdPolicy.ERROR,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.tables, self.config, self.seed = list(tables), config, seed
        self.id_policy = parse_enum(IdPolicy, id_policy, "embedding id_policy")
        self.plans = _plans(self.tables, config)
        if (
            resolve_backend(
                parse_enum(Backend, backend, "embedding backend"),
                torch.device(device or "cpu"),
                (optimizer or EmbeddingOptimizerConfig()).kind,
                [p.embedding_dim for plan in self.plans for p in plan.parts],
                (optimizer or EmbeddingOptimizerConfig()).weight_decay,
            )
            is Backend.FBGEMM
        ):
            odd = [p.name for plan in self.plans for p in plan.parts if p.embedding_dim % 4]
            if odd:
                raise ValueError(
                    f"FBGEMM kernels need embedding dims that are multiples of 4; tables {odd} "
                    "are not: set embedding.md_round_to = 4 (and md_min_dim >= 4), or "
                    "embedding.backend = 'torch'"
                )
        self.inner = EmbeddingBagCollection(
            [p for plan in self.plans for p in plan.parts],
            optimizer,
            backend=backend,
            device=device,
            seed=seed,
        )
        self._feature_plans = [(f, plan) for plan in self.plans for f in plan.table.feature_names]
        self.feature_names = [f for f, _ in self._feature_plans]
        self.embedding_dims = [plan.table.embedding_dim for _, plan in self._feature_plans]
        self._physical_names = [
            plan.physical_name(f, j)
            for f, plan in self._feature_plans
            for j in range(len(plan.parts))
        ]
        self._expand = any(plan.operation is Combine.MULT for plan in self.plans)
        self.projections = nn.ModuleDict(
            {
                plan.table.name: nn.Linear(
                    plan.parts[0].embedding_dim, plan.table.embedding_dim, bias=False
                )
                for plan in self.plans
                if plan.kind is EmbeddingKind.MD
                and plan.parts[0].embedding_dim < plan.table.embedding_dim
            }
        )
        rows = [plan.table.num_embeddings for _, plan in self._feature_plans]
        self.register_buffer(
            "_rows_per_feature",
            torch.tensor(rows, dtype=torch.int64, device=self.inner.device),
            persistent=False,
        )
        self.projections.to(self.inner.device)
        self.reset_parameters()

    @property
    def backend(self) -> Backend:
        return self.inner.backend

    @property
    def num_embedding_parameters(self) -> int:
        """Rows x dims of the physical tables plus the md projections."""
        return self.inner.num_embedding_parameters + sum(
            p.numel() for p in self.projections.parameters()
        )

    def collisions(self) -> dict[str, int]:
        """Ids of the id space that share a hashed row with another id, per hashed table."""
        return {
            plan.table.name: plan.table.num_embeddings - plan.sizes[0]
            for plan in self.plans
            if plan.kind is EmbeddingKind.HASH
        }

    def describe(self) -> list[dict[str, Any]]:
        """Per logical table: kind, physical rows and dims, parameters."""
        return [
            {
                "table": plan.table.name,
                "kind": plan.kind.value,
                "rows": [p.num_embeddings for p in plan.parts],
                "dims": [p.embedding_dim for p in plan.parts],
                "params": sum(p.num_parameters for p in plan.parts),
            }
            for plan in self.plans
        ]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.inner.reset_parameters()
        weights = self.inner.table_weights()
        for plan in self.plans:
            if plan.operation is Combine.MULT:
                for part in plan.parts[1:]:
                    weights[part.name].add_(1.0)  # factors 1 + U(-s, s)
        for name, proj in self.projections.items():
            assert isinstance(proj, nn.Linear)
            gen = torch.Generator().manual_seed(stable_seed("projection", self.seed, name))
            w = torch.randn(proj.weight.shape, generator=gen) / proj.in_features**0.5
            proj.weight.copy_(w)

    def flops_per_sample(self) -> int:
        """Dense FLOPs of projections and combinations, per sample (one id per feature)."""
        flops = 0
        for _, plan in self._feature_plans:
            if plan.table.name in self.projections:
                flops += 2 * plan.parts[0].embedding_dim * plan.table.embedding_dim
            elif plan.operation in (Combine.MULT, Combine.ADD):
                flops += (len(plan.parts) - 1) * plan.table.embedding_dim
        return flops

    def _combine(self, plan: _Plan, parts: list[torch.Tensor]) -> torch.Tensor:
        if plan.table.name in self.projections:
            return cast(torch.Tensor, self.projections[plan.table.name](parts[0]))
        if len(parts) == 1:
            return parts[0]
        if plan.operation is Combine.CONCAT:
            return torch.cat(parts, dim=1)
        out = parts[0]
        for p in parts[1:]:
            out = out * p if plan.operation is Combine.MULT else out + p
        return out

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if features.keys() != self.feature_names:
            features = features.select(self.feature_names)
        check_weighted_pooling(features, self.tables)
        values = apply_id_policy(features, self._rows_per_feature, self.id_policy).long()
        batch, lengths = features.stride(), features.lengths()
        weights = features.weights_or_none()
        bounds = features.offsets()[::batch].tolist()
        counts = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        # mult does not commute with pooling: look up one id per bag, pool after combining.
        expand = self._expand and (weights is not None or bool((lengths != 1).any()))
        width = max(max(counts), 1) if expand else batch
        phys_values, phys_lengths, phys_weights = [], [], []
        for f, (_, plan) in enumerate(self._feature_plans):
            ids = values[bounds[f] : bounds[f + 1]]
            if expand:
                lens = (torch.arange(width, device=ids.device) < counts[f]).to(lengths.dtype)
            else:
                lens = lengths[f * batch : (f + 1) * batch]
            for part_ids in plan.map_ids(ids):
                phys_values.append(part_ids)
                phys_lengths.append(lens)
                if weights is not None and not expand:
                    phys_weights.append(weights[bounds[f] : bounds[f + 1]])
        physical = KeyedJaggedTensor(
            self._physical_names,
            torch.cat(phys_values),
            torch.cat(phys_lengths),
            torch.cat(phys_weights) if phys_weights else None,
            validate=False,
        )
        looked_up = self.inner(physical).to_dict()
        outs = []
        for f, (feature, plan) in enumerate(self._feature_plans):
            parts = [looked_up[plan.physical_name(feature, j)] for j in range(len(plan.parts))]
            vectors = self._combine(plan, parts)
            if expand:
                vectors = self._pool(vectors[: counts[f]], f, batch, lengths, weights, bounds, plan)
            outs.append(vectors)
        return KeyedTensor(self.feature_names, self.embedding_dims, torch.cat(outs, dim=1))

    def forward_start(self, features: KeyedJaggedTensor) -> Ready:
        """``forward``, its result ready (the combination runs here, on the lookup's)."""
        return Ready(self(features))

    @staticmethod
    def _pool(
        vectors: torch.Tensor,
        f: int,
        batch: int,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        bounds: list[int],
        plan: _Plan,
    ) -> torch.Tensor:
        lens = lengths[f * batch : (f + 1) * batch].long()
        bag = torch.repeat_interleave(
            torch.arange(batch, device=vectors.device), lens, output_size=vectors.shape[0]
        )
        if weights is not None:
            vectors = vectors * weights[bounds[f] : bounds[f + 1]].unsqueeze(1)
        out = torch.zeros(batch, vectors.shape[1], dtype=vectors.dtype, device=vectors.device)
        out = out.index_add(0, bag, vectors)
        if plan.table.pooling is Pooling.MEAN:
            out = out / lens.clamp(min=1).unsqueeze(1).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        kinds = sorted({plan.kind.value for plan in self.plans})
        return f"kinds={kinds}, tables={len(self.tables)}"


def build_embedding_collection(
    tables: list[TableConfig],
    config: CompactConfig,
    optimizer: EmbeddingOptimizerConfig | None = None,
    *,
    materialize: bool = True,
    tiers: Mapping[str, TierConfig] | None = None,
    default_tier: TierConfig | None = None,
    **kwargs: Any,
) -> EmbeddingBagCollection | CompactEmbeddingCollection | CachedEmbeddingBagCollection:
    """A plain ``EmbeddingBagCollection`` for full tables, the cached collection when some
    run cached (``tiers`` per table, else ``default_tier``: ``TableTiers.place`` decides),
    else the compact collection.

    ``materialize=False`` leaves full tables unallocated (their shards initialise
    themselves when sharded; cached tables' shards are cached on their ranks, the
    collection carries the tables' placements for them: ``EmbeddingBagCollection.tiers``);
    compact collections are always built whole: their init is not a per-block function
    of the logical tables (mult factors, projections) and their tables are small by design.
    """
    config.check_table_names(tables)
    table_tiers = TableTiers(default_tier or TierConfig(), dict(tiers or {}))
    placements = table_tiers.place_tables(tables)
    cached = sorted(name for name, placement in placements.items() if placement.is_cached)
    if not cached:
        table_tiers.warn_if_nothing_cached(tables)
    if cached and not config.is_full:
        raise ValueError(
            f"tables {cached} run cached (memory = 'cached'), which needs every "
            "table stored in full; set embedding.kind = 'full' or memory = 'device'"
        )
    if cached and not materialize:  # sharded: each rank caches its own shards
        lazy = EmbeddingBagCollection(tables, optimizer, materialize=False, **kwargs)
        lazy.tiers = placements
        return lazy
    if cached:
        return CachedEmbeddingBagCollection(tables, optimizer, placements=placements, **kwargs)
    if config.is_full:
        if materialize:
            check_tables_fit(tables, optimizer, kwargs.get("device"))
        return EmbeddingBagCollection(tables, optimizer, materialize=materialize, **kwargs)
    return CompactEmbeddingCollection(tables, config, optimizer, **kwargs)


def device_memory_bytes(device: torch.device | str | None) -> int | None:
    """The memory of ``device``: a CUDA device's total, else this machine's physical
    memory; None where the system does not say."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return physical_memory_bytes()


def full_table_bytes(tables: list[TableConfig], optimizer: EmbeddingOptimizerConfig) -> int:
    """Bytes of ``tables`` held whole in float32 with ``optimizer``'s state per row."""
    total = 0
    for t in tables:
        shapes = optimizer.kind.state_shapes(1, t.embedding_dim).values()
        floats = t.embedding_dim + sum(math.prod(s[1:]) for s in shapes if s)
        total += t.num_embeddings * floats * 4
    return total


def check_tables_fit(
    tables: list[TableConfig],
    optimizer: EmbeddingOptimizerConfig | None,
    device: torch.device | str | None,
) -> None:
    """Refuse full tables held in memory (one process) that the device's memory cannot
    hold, before any allocation fails deep in a kernel; the message names the fixes."""
    limit = device_memory_bytes(device)
    need = full_table_bytes(tables, optimizer or EmbeddingOptimizerConfig())
    if limit is None or need <= limit:
        return
    largest = max(tables, key=lambda t: t.num_embeddings)
    where = "GPU" if torch.device(device or "cpu").type == "cuda" else "machine"
    raise ValueError(
        f"the {len(tables)} embedding tables need {need / 2**30:,.1f} GiB held whole with "
        f"their optimizer state (the largest, {largest.name!r}, has "
        f"{largest.num_embeddings:,} rows of dim {largest.embedding_dim}), more than this "
        f"{where}'s {limit / 2**30:,.1f} GiB. Hold them in a cache over a store "
        "(--set embedding.memory=cached --set embedding.backing=ssd, or backing=kv with "
        'embedding.cache_slots for sparse 64-bit ids; README, "Tables larger than memory"), '
        "shard them over the memory of several hosts, or give the data fewer rows per table "
        "(towerrec data criteo --num-embeddings)"
    )
