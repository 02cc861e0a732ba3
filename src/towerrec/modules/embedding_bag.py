"""EmbeddingBagCollection: pooled lookups of many tables, fused, optimizer in backward.

::

    KeyedJaggedTensor (keys = features)
        │  select the collection's features, check ids (policy: error | hash | clip)
        ▼
    fused kernel per (pooling, dim) group ── one call for all its tables
        │  backward: exact sparse optimizer updates the looked-up rows in place
        ▼
    KeyedTensor [B, sum(D_f)]  (features in ``feature_names`` order)

The weights and optimizer state are not ``nn.Parameter``s of the model: the
dense optimizer never sees them. They appear in ``state_dict()`` under
canonical per-table names, ``embedding_bags.<table>.weight``, and in
``optimizer_state_dict()`` as ``embedding_bags.<table>.<state>``
(``table_state.py``), the same for every backend and (in the sharded twin)
every layout.

``materialize=False`` builds the collection without allocating its tables: it
knows its features, dims and init (``seed``) but holds no weights. That is how
a distributed run builds its model: the sharded twin then allocates and
initialises only this rank's shards (``init_table_block`` makes any row/column
block of a table on its own), so no rank ever holds the full tables.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from enum import StrEnum
from typing import Any, Self

import torch
from torch import nn

from towerrec.modules.interfaces import FusedEmbeddingCollection, Ready
from towerrec.modules.kernels import (
    Backend,
    EmbeddingKernel,
    RowwiseSync,
    Storage,
    TableSpec,
    build_kernel,
    resolve_backend,
)
from towerrec.modules.native import fused
from towerrec.modules.table_state import (
    check_keys,
    copy_checked,
    load_table_weights,
    other_entries,
    save_table_weights,
    table_key,
)
from towerrec.modules.tables import Pooling, TableConfig, fill_table_block
from towerrec.modules.tiers import TablePlacement
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor, KeyedTensor
from towerrec.utils import parse_enum

__all__ = [
    "EmbeddingBagCollection",
    "IdPolicy",
    "apply_id_policy",
    "check_weighted_pooling",
    "dense_parameters",
    "fused_embedding_modules",
]


class IdPolicy(StrEnum):
    """What to do with an id outside ``[0, num_embeddings)``."""

    ERROR = "error"  # raise, naming the feature, id and table size (default)
    HASH = "hash"  # id mod num_embeddings
    CLIP = "clip"  # min(id, num_embeddings - 1)


def _in_range(values: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether every id is in its feature's ``[0, rows)``, by each feature's smallest and
    largest id (3x faster on the CPU than a limit per id, which the error message and the
    other policies still build; in one native pass where the extension is built, 2.7x
    faster again on the Criteo-Kaggle batch). Ids are key-major, feature f's from
    ``starts[f]``."""
    if (
        fused is not None
        and values.dtype == torch.int64
        and starts.dtype == torch.int64
        and rows.dtype == torch.int64
        and values.is_contiguous()
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
    ):
        return bool(
            fused.ids_in_range(
                values.numpy(), starts.contiguous().numpy(), rows.numpy(), rows.numel()
            )
        )
    counts = starts.diff().tolist()
    largest = torch.stack(
        [v.max() if n else v.new_zeros(()) for v, n in zip(values.split(counts), counts)]
    )
    return not bool((largest.long() >= rows.long()).any() | (values.min() < 0))


def apply_id_policy(
    features: KeyedJaggedTensor,
    rows_per_feature: torch.Tensor,
    policy: IdPolicy,
) -> torch.Tensor:
    """The ids of ``features`` checked or mapped into each feature's table range
    ``[0, rows)``: every path into a collection passes here (the kernels run without
    bounds checks), whatever built the batch."""
    values = features.values()
    if values.numel() == 0:
        return values
    batch = features.stride()
    starts = features.offsets()[::batch]
    if (
        policy is IdPolicy.ERROR
        and values.device.type == "cpu"
        and _in_range(values, starts, rows_per_feature)
    ):
        return values
    per_feature = starts.diff()
    limit = torch.repeat_interleave(rows_per_feature, per_feature, output_size=values.numel())
    if policy is IdPolicy.HASH:
        return torch.remainder(values, limit)
    if policy is IdPolicy.CLIP:
        return torch.minimum(values.clamp(min=0), limit - 1)
    bad = (values < 0) | (values >= limit)
    if bool(bad.any()):
        position = int(bad.nonzero()[0])
        offsets = features.offsets()
        bag = int(torch.searchsorted(offsets, position, right=True)) - 1
        feature, sample = divmod(bag, batch)
        raise ValueError(
            f"id {int(values[position])} of feature {features.keys()[feature]!r} (sample {sample}) "
            f"is out of range for its table of {int(rows_per_feature[feature])} rows; fix the "
            "data or table size, or set embedding.id_policy = 'hash' (id mod rows) or 'clip'"
        )
    return values


def check_weighted_pooling(features: KeyedJaggedTensor, tables: Sequence[TableConfig]) -> None:
    """Per-id weights pool by sum: refuse them for a mean-pooled table (FBGEMM would divide
    the weighted sum by the bag length, torch's ``embedding_bag`` has no weighted mean)."""
    if features.weights_or_none() is None:
        return
    keys = set(features.keys())
    for table in tables:
        if table.pooling is Pooling.MEAN and keys.intersection(table.feature_names):
            raise ValueError(
                f"table {table.name!r} pools by mean, but the batch carries per-id weights; "
                "weighted bags pool by sum: set the table's pooling to 'sum' "
                "(embedding.pooling = 'sum'), or drop the weights"
            )


class EmbeddingBagCollection(FusedEmbeddingCollection):
    """Pooled embedding lookups for many tables with a fused optimizer (module doc).

    A ``PooledEmbeddingCollection`` and a ``FusedEmbeddingCollection``
    (``modules/interfaces.py``).

    ``tiers``: each table's memory tier, decided on the full tables, that a sharded
    collection stores their shards by (``distributed/lookup.py``); set by
    ``build_embedding_collection`` on an unmaterialized collection with cached tables.
    """

    tiers: dict[str, TablePlacement] | None = None

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: EmbeddingOptimizerConfig | None = None,
        *,
        backend: Backend | str = Backend.AUTO,
        device: torch.device | str | None = None,
        id_policy: IdPolicy | str = IdPolicy.ERROR,
        seed: int = 0,
        materialize: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("an EmbeddingBagCollection needs at least one table")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        features = [f for t in tables for f in t.feature_names]
        if len(set(features)) != len(features):
            dup = sorted({f for f in features if features.count(f) > 1})
            raise ValueError(f"features {dup} are assigned to more than one table")
        self.tables = list(tables)
        self.optimizer = optimizer or EmbeddingOptimizerConfig()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.backend = resolve_backend(
            parse_enum(Backend, backend, "embedding backend"),
            self.device,
            self.optimizer.kind,
            [t.embedding_dim for t in self.tables],
            self.optimizer.weight_decay,
        )
        self.id_policy = parse_enum(IdPolicy, id_policy, "embedding id_policy")
        self.seed = seed

        # Group tables that one kernel can serve: same pooling and dim.
        groups: dict[tuple[Pooling, int], list[TableConfig]] = {}
        for t in self.tables:
            groups.setdefault((t.pooling, t.embedding_dim), []).append(t)
        self._groups = list(groups.values())
        self.feature_names = [f for group in self._groups for t in group for f in t.feature_names]
        self.embedding_dims = [
            t.embedding_dim for g in self._groups for t in g for _ in t.feature_names
        ]
        self._features_per_group = [sum(len(t.feature_names) for t in g) for g in self._groups]
        rows = [t.num_embeddings for g in self._groups for t in g for _ in t.feature_names]
        self._rows_per_feature = torch.tensor(rows, dtype=torch.int64, device=self.device)
        # Kernels are plain attributes, not submodules: their FBGEMM parameters
        # must stay out of model.parameters() (the dense optimizer, DDP).
        self._kernels: list[EmbeddingKernel] = []
        if materialize:
            self.materialize()

    @property
    def is_materialized(self) -> bool:
        """Whether the tables are allocated (see ``materialize=False`` in the module doc)."""
        return bool(self._kernels)

    def materialize(
        self, init: bool = True, storage: Storage | None = None
    ) -> EmbeddingBagCollection:
        """Allocate the tables (a no-op when they are); ``init`` fills them from ``seed``.
        ``storage(name, shape)`` supplies each kernel's tensors instead (the torch
        backend's ``TorchKernel``: e.g. memory-mapped files, ``bench/tiers.py``)."""
        if not self._kernels:
            self._kernels = self._build_kernels(self.device, storage)
            if init:
                self.reset_parameters()
        return self

    def _require_tables(self) -> None:
        if not self._kernels:
            raise ValueError(
                "this EmbeddingBagCollection was built with materialize=False and holds no "
                "tables; shard it (parallelize / ShardedEmbeddingBagCollection) or call "
                ".materialize() first"
            )

    def _build_kernels(
        self, device: torch.device, storage: Storage | None = None
    ) -> list[EmbeddingKernel]:
        kernels = []
        for group in self._groups:
            feature_table_map = [i for i, t in enumerate(group) for _ in t.feature_names]
            kernels.append(
                build_kernel(
                    self.backend,
                    [TableSpec(t.num_embeddings, t.embedding_dim) for t in group],
                    feature_table_map,
                    group[0].pooling,
                    self.optimizer,
                    device,
                    storage,
                )
            )
        return kernels

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from ``seed`` (see ``init_table_block``); state zeroed."""
        for table, weight in self._table_weights():
            fill_table_block(weight, table, self.seed)
        self.zero_optimizer_states()

    @torch.no_grad()
    def zero_optimizer_states(self) -> None:
        """Every table's optimizer state to zero (as at the start of training)."""
        for _, states in self._table_optimizer_states():
            for s in states.values():
                s.zero_()

    # ------------------------------------------------------------------ views
    def _table_weights(self) -> Iterator[tuple[TableConfig, torch.Tensor]]:
        for group, kernel in zip(self._groups, self._kernels):
            yield from zip(group, kernel.split_weights())

    def _table_optimizer_states(self) -> Iterator[tuple[TableConfig, dict[str, torch.Tensor]]]:
        for group, kernel in zip(self._groups, self._kernels):
            yield from zip(group, kernel.split_optimizer_states())

    def table_weights(self) -> dict[str, torch.Tensor]:
        """``{table: weight[rows, dim]}`` views; in-place writes reach the kernels."""
        self._require_tables()
        return {t.name: w for t, w in self._table_weights()}

    def table_views(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Table ``name``'s weight ``[rows, dim]`` and optimizer states by canonical name
        (the views ``table_weights`` and ``optimizer_state_dict`` hold), split from its
        own kernel only: a cached table's lookup asks for them each time."""
        self._require_tables()
        for group, kernel in zip(self._groups, self._kernels):
            for i, table in enumerate(group):
                if table.name == name:
                    return kernel.table_views(i)
        raise KeyError(f"no table {name!r} in this collection")

    def dense_table_weights(self) -> dict[str, torch.Tensor]:
        """``table_weights``: every table here is a dense array (a cached collection's kv
        tables are not)."""
        return self.table_weights()

    @property
    def num_embedding_parameters(self) -> int:
        return sum(t.num_parameters for t in self.tables)

    # ------------------------------------------------------------ optimizer
    def set_learning_rate(self, lr: float) -> None:
        for kernel in self._kernels:
            kernel.set_learning_rate(lr)

    def defer_rowwise(self, tables: Collection[str], sync: RowwiseSync) -> None:
        """Hand the row-wise Adagrad updates of ``tables`` to ``sync`` (a sharded
        collection's column shards; see ``modules/kernels/``)."""
        self._require_tables()
        for group, kernel in zip(self._groups, self._kernels):
            mine = {i: t.name for i, t in enumerate(group) if t.name in tables}
            if mine:
                kernel.defer_rowwise(mine, sync)

    def optimizer_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        self._require_tables()
        return {
            table_key(prefix, t.name, name): s
            for t, states in self._table_optimizer_states()
            for name, s in states.items()
        }

    @torch.no_grad()
    def load_optimizer_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "") -> None:
        expected = self.optimizer_state_dict(prefix)
        check_keys(expected, state, "embedding optimizer state")
        for key, target in expected.items():
            copy_checked(target, state[key], key)

    # ---------------------------------------------------------- state dict
    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        self._require_tables()
        super()._save_to_state_dict(destination, prefix, keep_vars)
        save_table_weights(destination, prefix, self.table_weights())

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
        self._require_tables()
        super()._load_from_state_dict(
            other_entries(state_dict, prefix),
            prefix,
            local_metadata,
            strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
        )
        load_table_weights(
            self.table_weights(), state_dict, prefix, missing_keys, unexpected_keys, error_msgs
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # .to(device) / .cuda(): rebuild the kernels on the new device, keeping state.
        target = fn(torch.empty(0, device=self.device)).device
        if target != self.device and not self._kernels:
            self.device = target
            self._rows_per_feature = self._rows_per_feature.to(target)
        elif target != self.device:
            weights = {k: w.to(target) for k, w in self.table_weights().items()}
            states = {k: s.to(target) for k, s in self.optimizer_state_dict().items()}
            self._kernels = self._build_kernels(target)
            self.device = target
            self._rows_per_feature = self._rows_per_feature.to(target)
            with torch.no_grad():
                for name, w in self.table_weights().items():
                    w.copy_(weights[name])
            self.load_optimizer_state_dict(states)
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call,no-any-return]  # torch leaves Module._apply untyped

    # -------------------------------------------------------------- forward
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        self._require_tables()
        if features.keys() != self.feature_names:
            features = features.select(self.feature_names)
        check_weighted_pooling(features, self.tables)
        values = apply_id_policy(features, self._rows_per_feature, self.id_policy)
        weights = features.weights_or_none()
        offsets = features.offsets()
        if len(self._kernels) == 1:
            pooled = self._kernels[0](values, offsets, weights)
        else:
            batch = features.stride()
            outs, first = [], 0
            for kernel, count in zip(self._kernels, self._features_per_group):
                lo, hi = int(offsets[first * batch]), int(offsets[(first + count) * batch])
                part_offsets = offsets[first * batch : (first + count) * batch + 1] - lo
                part_weights = weights[lo:hi] if weights is not None else None
                outs.append(kernel(values[lo:hi], part_offsets, part_weights))
                first += count
            pooled = torch.cat(outs, dim=1)
        return KeyedTensor(self.feature_names, self.embedding_dims, pooled)

    def forward_start(self, features: KeyedJaggedTensor) -> Ready:
        """``forward``, its result ready (a local lookup has nothing in flight)."""
        return Ready(self(features))

    def extra_repr(self) -> str:
        return (
            f"tables={len(self.tables)}, features={len(self.feature_names)}, "
            f"params={self.num_embedding_parameters:,}, backend={self.backend.value}, "
            f"optimizer={self.optimizer.kind.value}"
            + ("" if self._kernels else ", not materialized")
        )


def fused_embedding_modules(model: nn.Module) -> Iterator[tuple[str, FusedEmbeddingCollection]]:
    """``(fqn, module)`` of every module whose optimizer runs inside backward."""
    for name, module in model.named_modules():
        if isinstance(module, FusedEmbeddingCollection):
            yield name, module


def dense_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Named parameters that the dense optimizer owns (not under fused embeddings)."""
    fused = [name + "." for name, _ in fused_embedding_modules(model)]
    for name, param in model.named_parameters():
        if not any(name.startswith(prefix) for prefix in fused):
            yield name, param
