"""Settings of memory-efficient embedding collections (``modules/compact.py``).

``CompactConfig`` says how a collection stores its tables; its ``tables``
map overrides the settings of single tables (``TableStorageConfig``)::

    CompactConfig(kind="full", tables={"cat_3": TableStorageConfig(kind="qr", compression=8)})
        cat_3: QR 8x, whatever its size; every other table: full
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum

from towerrec.modules.compositional import PartitionScheme
from towerrec.modules.tables import TableConfig, canonical_init, check_init_scale
from towerrec.modules.tiers import (
    Background,
    Backing,
    CacheMaps,
    CachePolicy,
    Memory,
    SsdReads,
    TierConfig,
    parse_background,
)
from towerrec.utils import above, at_least, parse_enum

__all__ = ["Combine", "CompactConfig", "EmbeddingKind", "TableStorageConfig"]


class EmbeddingKind(StrEnum):
    FULL = "full"  # one row per id
    HASH = "hash"  # id mod m: the baseline, with collisions
    QR = "qr"  # complementary partitions (quotient-remainder and generalisations)
    MD = "md"  # mixed dimensions by popularity, projected to the common dim


class Combine(StrEnum):
    MULT = "mult"
    ADD = "add"
    CONCAT = "concat"


@dataclass(frozen=True)
class TableStorageConfig:
    """How one table is stored, overriding the collection's settings; None: the collection's.

    Field names are those of the run config's ``embedding`` section.
    """

    kind: EmbeddingKind | None = None
    compression: float | None = None
    qr_operation: Combine | None = None
    qr_partitions: int | None = None
    qr_scheme: PartitionScheme | None = None
    # A full table stored at this narrower dim, projected to the common dim (as md does
    # for every table); what ``towerrec nas search --space emb_dim`` writes.
    dim: int | None = None
    # The table's memory tier (``modules/tiers.py``, ``TierConfig``'s fields of the same
    # names); kind = 'full' tables only.
    memory: Memory | None = None
    cache_fraction: float | None = None
    cache_policy: CachePolicy | None = None
    backing: Backing | None = None
    backing_path: str | None = None
    cache_slots: int | None = None
    cache_maps: CacheMaps | None = None
    write_behind: Background | bool | None = None
    ssd_reads: SsdReads | None = None
    # How the table's rows start (``modules/tables.py``, ``INIT_RULES``): any kind.
    init: str | None = None
    init_scale: float | None = None

    def __post_init__(self) -> None:
        at_least("dim", self.dim, 1, hint="a table's stored width")
        if self.init is not None:
            object.__setattr__(self, "init", canonical_init(self.init, "init"))
        check_init_scale(self.init_scale, "init_scale")
        if self.kind is not None:
            object.__setattr__(self, "kind", parse_enum(EmbeddingKind, self.kind, "kind"))
        if self.qr_operation is not None:
            object.__setattr__(
                self, "qr_operation", parse_enum(Combine, self.qr_operation, "qr_operation")
            )
        if self.qr_scheme is not None:
            object.__setattr__(
                self, "qr_scheme", parse_enum(PartitionScheme, self.qr_scheme, "qr_scheme")
            )
        for name, cls in (
            ("memory", Memory),
            ("cache_policy", CachePolicy),
            ("backing", Backing),
            ("cache_maps", CacheMaps),
            ("ssd_reads", SsdReads),
        ):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_enum(cls, value, name))
        if self.write_behind is not None:
            object.__setattr__(
                self, "write_behind", parse_background(self.write_behind, "write_behind")
            )
        if self.cache_fraction is not None and not (
            math.isfinite(self.cache_fraction) and self.cache_fraction > 0
        ):
            raise ValueError(
                f"cache_fraction must be > 0 (the share of the table's rows kept in the fast "
                f"tier, e.g. 0.05), got {self.cache_fraction}"
            )
        if self.kind is EmbeddingKind.MD:
            raise ValueError(
                "kind = 'md' cannot be set per table: mixed dimensions are chosen from the "
                "popularity of all tables together; set embedding.kind = 'md' for all tables"
            )
        above("compression", self.compression, 1, hint="rows are divided by it")
        at_least("qr_partitions", self.qr_partitions, 2, hint="2 = quotient-remainder")

    def set_fields(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def tier(self, base: TierConfig) -> TierConfig:
        """This table's memory tier: the tier fields it sets over the collection's ``base``
        (a table given its own ``memory`` takes it whatever its size)."""
        values = {name: getattr(self, name) for name in _TIER_FIELDS}
        overrides = {name: value for name, value in values.items() if value is not None}
        if self.memory is not None:
            overrides["cache_min_rows"] = 0
        return replace(base, **overrides)


_TIER_FIELDS = (
    "memory",
    "cache_fraction",
    "cache_policy",
    "backing",
    "backing_path",
    "cache_slots",
    "cache_maps",
    "write_behind",
    "ssd_reads",
)


_QR_ONLY = ("qr_operation", "qr_partitions", "qr_scheme")
_INIT_FIELDS = ("init", "init_scale")
_ANY_KIND_FIELDS = (*_TIER_FIELDS, *_INIT_FIELDS)  # (tiers are checked on their own)


@dataclass(frozen=True)
class CompactConfig:
    """How the tables of a collection are stored (see module docstring).

    ``compression`` divides the rows of hashed tables and of the largest
    (remainder) table of a partition; only tables with more than
    ``row_threshold`` rows are compressed. ``md_budget = 0`` gives the most
    popular table the full dim; otherwise dims fit ``sum rows * dim <= budget``.
    """

    kind: EmbeddingKind = EmbeddingKind.FULL
    compression: float = 4.0
    row_threshold: int = 0
    operation: Combine = Combine.MULT
    num_partitions: int = 2
    scheme: PartitionScheme = PartitionScheme.QUOTIENT_REMAINDER
    md_alpha: float = 0.3
    md_budget: int = 0
    md_min_dim: int = 4
    md_round_to: int = 4  # FBGEMM kernels need dims that are multiples of 4
    dim: int = 0  # a full table stored at this dim and projected (per table only); 0: not
    tables: Mapping[str, TableStorageConfig] = field(default_factory=dict)  # per-table overrides

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", parse_enum(EmbeddingKind, self.kind, "embedding.kind"))
        self._check_tables()
        object.__setattr__(
            self, "operation", parse_enum(Combine, self.operation, "embedding.qr_operation")
        )
        object.__setattr__(
            self, "scheme", parse_enum(PartitionScheme, self.scheme, "embedding.qr_scheme")
        )
        above("embedding.compression", self.compression, 1, hint="rows are divided by it")
        at_least("embedding.row_threshold", self.row_threshold, 0)
        at_least("embedding.qr_partitions", self.num_partitions, 2, hint="2 = quotient-remainder")
        at_least("embedding.md_alpha", self.md_alpha, 0)
        if self.md_budget < 0 or self.md_min_dim < 1 or self.md_round_to < 1:
            raise ValueError(
                "embedding.md_budget must be >= 0 and md_min_dim, md_round_to >= 1, got "
                f"{self.md_budget}, {self.md_min_dim}, {self.md_round_to}"
            )

    def _check_tables(self) -> None:
        if self.tables and self.kind is EmbeddingKind.MD:
            raise ValueError(
                "embedding.kind = 'md' sets every table's dim from the popularity of all "
                f"tables, so it takes no per-table settings (embedding.tables: "
                f"{', '.join(self.tables)}); remove them, or use kind = 'hash' or 'qr'"
            )
        for name, table in self.tables.items():
            kind = table.kind or self.kind
            set_fields = [f for f in table.set_fields() if f not in _ANY_KIND_FIELDS]
            unused = {
                EmbeddingKind.FULL: [f for f in set_fields if f not in ("kind", "dim")],
                EmbeddingKind.HASH: [f for f in set_fields if f in (*_QR_ONLY, "dim")],
            }.get(kind, [f for f in set_fields if f == "dim"])
            if unused:
                raise ValueError(
                    f"embedding.tables.{name} sets {', '.join(unused)}, which a "
                    f"{kind.value!r} table does not use; set its kind (e.g. kind = 'qr') "
                    "or remove them"
                )

    def for_table(self, name: str) -> CompactConfig:
        """The settings table ``name`` is stored by (its overrides over the collection's)."""
        table = self.tables.get(name)
        if table is None or set(table.set_fields()) <= set(_INIT_FIELDS):
            return self  # (how a table starts is no storage setting)
        return replace(
            self,
            kind=table.kind or self.kind,
            compression=table.compression or self.compression,
            operation=table.qr_operation or self.operation,
            num_partitions=table.qr_partitions or self.num_partitions,
            scheme=table.qr_scheme or self.scheme,
            dim=table.dim or 0,
            row_threshold=0,  # a table named in the overrides is stored as they say
            tables={},
        )

    def check_table_names(self, tables: list[TableConfig]) -> None:
        unknown = sorted(set(self.tables) - {t.name for t in tables})
        if unknown:
            raise ValueError(
                f"embedding.tables names {unknown}, which are not tables of this model; its "
                f"tables: {', '.join(t.name for t in tables)}"
            )

    @property
    def is_full(self) -> bool:
        """Every table stored whole (a plain ``EmbeddingBagCollection`` does)."""
        kinds = {self.kind} | {t.kind or self.kind for t in self.tables.values()}
        narrowed = any(t.dim is not None for t in self.tables.values())
        return kinds == {EmbeddingKind.FULL} and not narrowed
