"""``[embedding]``: the embedding tables' kernel, optimizer, init, storage and memory
tier, with ``[embedding.tables.<table>]`` overrides of single tables."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from towerrec.modules.compact import (
    Combine,
    CompactConfig,
    EmbeddingKind,
    TableStorageConfig,
)
from towerrec.modules.compositional import PartitionScheme
from towerrec.modules.embedding_bag import IdPolicy
from towerrec.modules.kernels import Backend
from towerrec.modules.tables import (
    INIT_RULES,
    Pooling,
    canonical_init,
    check_init_scale,
    resolve_init,
)
from towerrec.modules.tiers import (
    Background,
    Backing,
    CacheMaps,
    CachePolicy,
    Memory,
    SsdReads,
    TableTiers,
    TierConfig,
    parse_background,
)
from towerrec.optim.sparse import EmbeddingOptimizer, EmbeddingOptimizerConfig, WeightDecayMode
from towerrec.utils import at_least, positive

__all__ = ["EmbeddingConfig"]


@dataclass(frozen=True)
class EmbeddingConfig:
    """Embedding tables: one per categorical feature, dim ``model.embedding_dim``."""

    backend: Backend = Backend.AUTO
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD
    lr: float = 0.5
    eps: float = 1e-8
    id_policy: IdPolicy = IdPolicy.ERROR
    pooling: Pooling = Pooling.SUM
    # How every table's rows start (modules/tables.py, INIT_RULES): uniform_rows | normal_rows
    # (scale sqrt(1/rows)) | uniform_scale | normal_scale (scale init_scale); "uniform" and
    # "normal" are the _rows rules' earlier names. normal_scale at 0.01: best or within noise
    # of uniform_rows on every data set of `towerrec bench init` (docs/benchmarks.md)
    init: str = "normal_scale"
    init_scale: float = 0.01  # uniform_scale: the bound; normal_scale: the std
    # Memory-efficient tables (modules/compact.py): full | hash | qr | md.
    kind: EmbeddingKind = EmbeddingKind.FULL
    compression: float = 4.0  # hash, qr: rows divided by this
    row_threshold: int = 0  # hash, qr: only tables with more rows are compressed
    qr_operation: Combine = Combine.MULT  # mult | add | concat
    qr_partitions: int = 2  # 2: quotient-remainder; more: complementary partitions
    qr_scheme: PartitionScheme = PartitionScheme.QUOTIENT_REMAINDER  # or crt
    md_alpha: float = 0.3  # md: dim ~ popularity^alpha
    md_budget: int = 0  # md: total rows*dims; 0: the most popular table keeps the full dim
    md_min_dim: int = 4
    md_round_to: int = 4  # FBGEMM kernels need dims that are multiples of 4
    counter_halflife: float = 0.0  # cf_sgd: steps for a row's count to halve; 0 = no decay
    adam_betas: tuple[float, float] = (0.9, 0.999)  # adam, partial_rowwise_adam
    # Of the rows a batch touches: rowwise_adagrad (decoupled or l2), adam (decoupled); of
    # every row: dense_adam (decoupled).
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayMode = WeightDecayMode.DECOUPLED
    # Memory tier (modules/cached.py): device | cached (a cache over a backing store). These
    # keys are the fields of modules/tiers.py's TierConfig, by name (``tiers``).
    memory: Memory = Memory.DEVICE
    cache_fraction: float = 0.05  # cached: share of a table's rows in the fast tier
    cache_policy: CachePolicy = CachePolicy.LRU  # cached: lru | lfu
    # cached: host (array in host memory) | ssd (row file) | kv (LMDB keyed by 64-bit id)
    backing: Backing = Backing.HOST
    backing_path: str = ""  # ssd: directory of the tables' row files
    cache_min_rows: int = 0  # cached: only tables with more rows are cached
    cache_slots: int = 0  # cached: the cache's rows (0: cache_fraction); kv needs it
    # cached: where the id -> slot maps and victim choice run: auto (device on a GPU, else
    # host) | host | device (beside the slot tables: only missed and evicted rows cross)
    cache_maps: CacheMaps = CacheMaps.AUTO
    # cached over ssd: an eviction's write-back lands in a thread of the store's own while the
    # step goes on (a read waits for it first); off (or false): written within the lookup;
    # auto: on on a GPU, or when the process has a core beyond its torch threads (logged); on
    write_behind: Background | bool = Background.AUTO
    # cached: read the next batch's misses in a background thread while this step computes
    # (sharded runs: under the pipelined input_dist, which this turns on); auto | on | off as
    # write_behind (auto: on a GPU, or where every rank has a core beyond its torch threads)
    prefetch: Background | bool = Background.AUTO
    # cached over ssd: how a batch's missed rows are read and its evicted rows written back:
    # mapped (a gather from and a scatter into the row files' mapping, the page cache's pages
    # mapped into the process; writes by io where a file's blocks are not reserved in place) | io
    # (pread / io_uring, many reads in flight for a disk) | auto: mapped when the files take
    # at most half of the memory available (logged), else io
    ssd_reads: SsdReads = SsdReads.AUTO
    # Per-table storage, [embedding.tables.<table>]: kind, compression, qr_*, dim, memory,
    # cache_*, backing*, init, init_scale; unset: the above.
    tables: dict[str, TableStorageConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive("embedding.lr", self.lr)
        for key in ("write_behind", "prefetch"):
            value = parse_background(getattr(self, key), f"embedding.{key}")
            object.__setattr__(self, key, value)
        positive("embedding.eps", self.eps)
        object.__setattr__(self, "init", canonical_init(self.init, "embedding.init"))
        check_init_scale(self.init_scale, "embedding.init_scale")
        self._check_init_scales()
        self.compact()
        tiers = self.tiers()
        cached = [t for t, tier in tiers.tables.items() if tier.asks_for_cache]
        if tiers.default.asks_for_cache:
            cached = ["every table"]
        if self.optimizer is EmbeddingOptimizer.DENSE_ADAM and cached:
            raise ValueError(
                "embedding.optimizer = 'dense_adam' moves every row of a table every step, "
                f"but memory = 'cached' keeps most rows outside memory ({', '.join(cached)}): "
                "use 'adam' (the rows a batch touches), or memory = 'device'"
            )
        at_least("embedding.counter_halflife", self.counter_halflife, 0)
        if len(self.adam_betas) != 2:
            raise ValueError(
                f"embedding.adam_betas must be [beta1, beta2], got {list(self.adam_betas)}"
            )
        self.optimizer_config()  # the same refusals on every backend, first
        if self.optimizer is EmbeddingOptimizer.CF_SGD and self.backend is Backend.FBGEMM:
            raise ValueError(
                "embedding.optimizer = 'cf_sgd' has no FBGEMM kernel; set embedding.backend = "
                "'torch' (or 'auto', which picks the torch kernel for it)"
            )

    def _check_init_scales(self) -> None:
        """Refuse an ``init_scale`` that no table's rule reads: a ``_rows`` rule scales by
        the rows."""
        readers = [  # tables of a scale rule of their own that take this init_scale
            name
            for name, t in self.tables.items()
            if t.init and not INIT_RULES[t.init].by_rows and t.init_scale is None
        ]
        by_rows = INIT_RULES[self.init].by_rows
        if by_rows and self.init_scale != EmbeddingConfig.init_scale and not readers:
            raise ValueError(
                f"embedding.init_scale = {self.init_scale} is not used: embedding.init = "
                f"{self.init!r} scales each table by sqrt(1/rows); set embedding.init = "
                f"'{INIT_RULES[self.init].distribution}_scale' to start from "
                f"{self.init_scale}, or drop init_scale"
            )
        for name, table in self.tables.items():
            rule = table.init or self.init
            if table.init_scale is not None and INIT_RULES[rule].by_rows:
                raise ValueError(
                    f"embedding.tables.{name}.init_scale = {table.init_scale} is not used: "
                    f"the table's init {rule!r} scales by sqrt(1/rows); set its init = "
                    f"'{INIT_RULES[rule].distribution}_scale', or drop init_scale"
                )

    def table_init(self, name: str) -> tuple[str, float | None]:
        """Table ``name``'s ``(init, init_scale)`` as ``TableConfig`` takes them: its
        ``[embedding.tables.<name>]`` rule and scale over this section's."""
        table = self.tables.get(name, TableStorageConfig())
        scale = table.init_scale if table.init_scale is not None else self.init_scale
        return resolve_init(table.init or self.init, scale)

    def optimizer_config(self) -> EmbeddingOptimizerConfig:
        """The fused optimizer's settings (validated there, the same for both backends)."""
        return EmbeddingOptimizerConfig(
            kind=self.optimizer,
            lr=self.lr,
            eps=self.eps,
            counter_halflife=self.counter_halflife,
            beta1=self.adam_betas[0],
            beta2=self.adam_betas[1],
            weight_decay=self.weight_decay,
            weight_decay_mode=self.weight_decay_mode,
        )

    def tiers(self) -> TableTiers:
        """Every table's memory tier (``modules/tiers.py``): the tier keys of this section
        (``TierConfig``'s fields), over which ``[embedding.tables.<t>]`` sets a table's
        own; refuses a cached table that is not stored in full."""
        base = TierConfig(**{f.name: getattr(self, f.name) for f in fields(TierConfig)})
        tiers = {name: table.tier(base) for name, table in self.tables.items()}
        if base.asks_for_cache and self.kind is not EmbeddingKind.FULL:
            raise ValueError(
                f"embedding.memory = 'cached' caches full tables, but embedding.kind = "
                f"{self.kind.value!r}; set embedding.kind = 'full', or cache single tables "
                "under [embedding.tables.<table>] memory = 'cached'"
            )
        for name, tier in tiers.items():
            table = self.tables[name]
            kind = table.kind or self.kind
            if tier.asks_for_cache and (kind is not EmbeddingKind.FULL or table.dim is not None):
                raise ValueError(
                    f"embedding.tables.{name}: memory = 'cached' caches a full table, but it is "
                    f"stored as kind = {kind.value!r}"
                    + (f" with dim = {table.dim}" if table.dim is not None else "")
                    + "; set memory = 'device' or store it in full"
                )
        return TableTiers(base, tiers)

    def compact(self) -> CompactConfig:
        return CompactConfig(
            kind=self.kind,
            compression=self.compression,
            row_threshold=self.row_threshold,
            operation=self.qr_operation,
            num_partitions=self.qr_partitions,
            scheme=self.qr_scheme,
            md_alpha=self.md_alpha,
            md_budget=self.md_budget,
            md_min_dim=self.md_min_dim,
            md_round_to=self.md_round_to,
            tables=self.tables,
        )
