"""The config sections: one frozen dataclass per component, each validating its own
values (``ConfigError`` names the key and the fix), and ``RESUME_SAFE_KEYS``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from towerrec.data.loader import LoaderConfig
from towerrec.data.movielens import MovieLensConfig
from towerrec.data.synthetic import SyntheticConfig
from towerrec.models.dcn import DCNConfig
from towerrec.models.dmt import DMTConfig
from towerrec.models.wukong import WukongConfig
from towerrec.modules.compact import (
    Combine,
    CompactConfig,
    EmbeddingKind,
    TableStorageConfig,
)
from towerrec.modules.compositional import PartitionScheme
from towerrec.modules.embedding_bag import IdPolicy
from towerrec.modules.kernels import Backend
from towerrec.modules.tables import Pooling
from towerrec.nas.config import NASConfig
from towerrec.optim.shampoo import ShampooSettings
from towerrec.optim.sparse import EmbeddingOptimizer, EmbeddingOptimizerConfig, WeightDecayMode
from towerrec.sharding import TOWER_SHARDINGS, ShardingType

__all__ = [
    "RESUME_SAFE_KEYS",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EarlyStoppingConfig",
    "EmbeddingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PlanConfig",
    "TrainConfig",
]

# Settings a resumed run may change (``--resume --set KEY=VALUE``): how long it runs,
# what it logs and keeps, how it reads data and how it is laid out over ranks; a
# checkpoint resumes under any layout. Any other change to the saved config is refused.
RESUME_SAFE_KEYS = (
    "train.steps",  # extends (or shortens) the run; the LR decay then ends at the new step
    "train.log_every",
    "train.eval_every",
    "train.eval_batch_size",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.progress",
    "train.tensorboard",
    "train.threads",
    "train.device",
    "data.loader.num_workers",
    "data.loader.prefetch",
    "data.loader.pin_memory",
    "data.loader.verify",
    "distributed.sharding",
    "distributed.tower_sharding",
    "distributed.pipeline",
    "distributed.timeout_s",
    "plan.*",
)


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says which and how to fix it."""


def _choice(value: str, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ValueError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(frozen=True)
class DataConfig:
    """``source``: synthetic (built in), movielens (``path``: its directory, empty for the
    bundled one), criteo or cache (``path``: a cache written by ``towerrec data``)."""

    source: str = "synthetic"
    path: str = ""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    movielens: MovieLensConfig = field(default_factory=MovieLensConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)

    def __post_init__(self) -> None:
        _choice(self.source, ("synthetic", "movielens", "criteo", "cache"), "data.source")
        if self.source == "synthetic" and self.path:
            warnings.warn(
                f"data.path = {self.path!r} is ignored: data.source is 'synthetic' "
                "(set data.source to movielens, criteo or cache to read files)",
                stacklevel=2,
            )
        if self.source in ("criteo", "cache") and not self.path:
            raise ValueError(
                f"data.source = {self.source!r} needs data.path, the directory written by "
                "`towerrec data criteo INPUT... --out DIR` (--set data.path=DIR)"
            )


@dataclass(frozen=True)
class EmbeddingConfig:
    """Embedding tables: one per categorical feature, dim ``model.embedding_dim``."""

    backend: Backend = Backend.AUTO
    optimizer: EmbeddingOptimizer = EmbeddingOptimizer.ROWWISE_ADAGRAD
    lr: float = 0.5
    eps: float = 1e-8
    id_policy: IdPolicy = IdPolicy.ERROR
    pooling: Pooling = Pooling.SUM
    init: str = "uniform"
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
    # Of the rows a batch touches: rowwise_adagrad (decoupled or l2), adam (decoupled).
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayMode = WeightDecayMode.DECOUPLED
    # Per-table storage, [embedding.tables.<table>]: kind, compression, qr_*; unset: the above.
    tables: dict[str, TableStorageConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"embedding.lr must be > 0, got {self.lr}")
        if not self.eps > 0:
            raise ValueError(f"embedding.eps must be > 0, got {self.eps}")
        _choice(self.init, ("uniform", "normal"), "embedding.init")
        self.compact()
        if self.counter_halflife < 0:
            raise ValueError(
                f"embedding.counter_halflife must be >= 0, got {self.counter_halflife}"
            )
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


@dataclass(frozen=True)
class ModelConfig:
    name: str = "dlrm"
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 32, 1)
    self_interaction: bool = False
    concat_embeddings: bool = False  # dlrm: the top MLP reads the pooled embeddings too
    dropout: float = 0.0  # after each hidden ReLU of every MLP, in training only
    batch_norm: bool = False  # BatchNorm1d before each hidden ReLU of every MLP
    dcn: DCNConfig = field(default_factory=DCNConfig)  # model.name = "dcn"
    wukong: WukongConfig = field(default_factory=WukongConfig)  # model.name = "wukong"
    dmt: DMTConfig = field(default_factory=DMTConfig)  # model.name = "dmt"

    def __post_init__(self) -> None:
        _choice(self.name, ("dlrm", "dcn", "wukong", "dmt"), "model.name")
        if self.embedding_dim < 1:
            raise ValueError(f"model.embedding_dim must be >= 1, got {self.embedding_dim}")
        if not 0 <= self.dropout < 1:
            raise ValueError(
                f"model.dropout = {self.dropout} must lie in [0, 1): the share of hidden "
                "activations zeroed in training (0 = none, e.g. 0.1)"
            )
        if self.concat_embeddings and self.name != "dlrm":
            warnings.warn(
                f"model.concat_embeddings is ignored: it is an option of model.name = 'dlrm', "
                f"not {self.name!r}",
                stacklevel=2,
            )
        if self.name == "wukong" and self.wukong.dense_rows > 1:
            end = self.wukong.dense_rows * self.embedding_dim
            if self.bottom_mlp and self.bottom_mlp[-1] != end:
                raise ValueError(
                    f"model.bottom_mlp must end at model.wukong.dense_rows * embedding_dim = "
                    f"{end} (got {list(self.bottom_mlp)}); e.g. bottom_mlp = [64, {end}]"
                )
        elif self.bottom_mlp and self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"model.bottom_mlp must end at model.embedding_dim = {self.embedding_dim} "
                f"(got {list(self.bottom_mlp)}); e.g. bottom_mlp = [64, {self.embedding_dim}]"
            )
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ValueError(f"model.top_mlp must end in 1 (one logit), got {list(self.top_mlp)}")


@dataclass(frozen=True)
class OptimizerConfig:
    """The dense optimizer and the learning-rate schedule (applied to embeddings too)."""

    name: str = "adam"
    lr: float = 2e-3
    weight_decay: float = 0.0  # adam: decoupled (AdamW); adagrad, sgd: L2 added to the gradient
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 100
    decay: str = "cosine"  # none | linear | cosine | plateau, after warm-up
    min_lr_ratio: float = 0.1  # the lowest LR factor of every decay
    # plateau: the LR factor is multiplied by plateau_factor after plateau_patience
    # validations in a row without improving train.early_stopping.metric
    plateau_factor: float = 0.5
    plateau_patience: int = 2
    shampoo: ShampooSettings = field(default_factory=ShampooSettings)  # name = "shampoo"

    def __post_init__(self) -> None:
        _choice(self.name, ("adam", "adagrad", "sgd", "shampoo"), "optimizer.name")
        _choice(self.decay, ("none", "linear", "cosine", "plateau"), "optimizer.decay")
        if not 0 < self.plateau_factor < 1:
            raise ValueError(
                f"optimizer.plateau_factor must lie in (0, 1), got {self.plateau_factor}"
            )
        if self.plateau_patience < 1:
            raise ValueError(
                f"optimizer.plateau_patience must be >= 1, got {self.plateau_patience}"
            )
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(
                f"optimizer.weight_decay must be >= 0 (0 = none, e.g. 0.01), got {self.weight_decay}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optimizer.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class EarlyStoppingConfig:
    """``train.early_stopping``: stop when the validation ``metric`` has not improved by more
    than ``min_delta`` for ``patience`` evaluations in a row, then restore the best weights
    (kept in ``<run>/best/``). ``patience = 0``: off. ``metric`` also drives
    ``optimizer.decay = "plateau"``."""

    metric: str = "logloss"  # logloss (lower is better) | auc (higher is better)
    patience: int = 0
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        _choice(self.metric, ("logloss", "auc"), "train.early_stopping.metric")
        if self.patience < 0:
            raise ValueError(
                f"train.early_stopping.patience must be >= 0 (0: off), got {self.patience}"
            )
        if not self.min_delta >= 0:
            raise ValueError(f"train.early_stopping.min_delta must be >= 0, got {self.min_delta}")


@dataclass(frozen=True)
class TrainConfig:
    """``steps`` global batches, or ``epochs`` passes over a data set's training rows
    (one of the two). Neither set: 2,500 steps on synthetic data, one epoch on real
    data (``train.build.resolve_steps``)."""

    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 2048
    eval_every: int | str = 500  # steps between validations, or "epoch"; 0: only at the end
    eval_batch_size: int = 16384
    log_every: int = 50
    checkpoint_every: int = 0  # 0: only at the end of the run
    keep_checkpoints: int = 2
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads; 0 = PyTorch's default
    progress: bool = True
    precision: str = "fp32"  # fp32 | bf16 (autocast of the dense part, fp32 master weights)
    tensorboard: bool = False  # TensorBoard event files beside metrics.jsonl (extra: tensorboard)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)

    def __post_init__(self) -> None:
        _choice(self.precision, ("fp32", "bf16"), "train.precision")
        if isinstance(self.eval_every, str) and self.eval_every != "epoch":
            raise ValueError(
                f'train.eval_every = {self.eval_every!r}: give a number of steps or "epoch"'
            )
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"train.steps = {self.steps} and train.epochs = {self.epochs:g} are both set; "
                "set one of them (steps counts global batches, epochs passes over the "
                "training rows)"
            )
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"train.epochs must be > 0, got {self.epochs}")
        for key in ("steps", "batch_size", "eval_batch_size", "log_every"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"train.{key} must be >= 1, got {value}")
        for key in ("eval_every", "checkpoint_every", "threads"):
            if isinstance(getattr(self, key), int) and getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if self.keep_checkpoints < 1:
            raise ValueError("train.keep_checkpoints must be >= 1")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"train.device = {self.device!r}; use auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class PlanConfig:
    """How embedding tables are sharded over ranks (``towerrec plan`` shows the result).

    ``strategy``: ``none`` (every table sharded the one way ``distributed.sharding``
    says), ``auto`` (plan from the data's statistics with ``planner``) or ``file``
    (the plan JSON at ``path``). A multi-process run plans for its own hosts and
    ranks; ``towerrec plan`` uses ``hosts`` and ``ranks_per_host`` (0: the world
    size over ``hosts``);
    ``device_memory_gib = 0`` the ``topology`` preset's; ``calibration`` is a
    cost-constants JSON written by ``towerrec plan --calibrate``.
    """

    strategy: str = "none"
    path: str = ""
    planner: str = "search"
    topology: str = "cpu"
    hosts: int = 1
    ranks_per_host: int = 0
    device_memory_gib: float = 0.0
    calibration: str = ""
    stats_batches: int = 8
    stats_batch_size: int = 1024

    def __post_init__(self) -> None:
        from towerrec.planner.search import PLANNERS
        from towerrec.planner.topology import PRESETS

        _choice(self.strategy, ("none", "auto", "file"), "plan.strategy")
        _choice(self.planner, PLANNERS, "plan.planner")
        _choice(self.topology, tuple(PRESETS), "plan.topology")
        if self.strategy == "file" and not self.path:
            raise ValueError("plan.strategy = 'file' needs plan.path (a JSON from towerrec plan)")
        if self.hosts < 1 or self.ranks_per_host < 0:
            raise ValueError("plan.hosts must be >= 1 and plan.ranks_per_host >= 0")
        if self.device_memory_gib < 0:
            raise ValueError("plan.device_memory_gib must be >= 0 (0 = the topology preset's)")
        if self.stats_batches < 1 or self.stats_batch_size < 1:
            raise ValueError("plan.stats_batches and plan.stats_batch_size must be >= 1")


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (``towerrec train --nproc N`` or torchrun); ignored in one process."""

    sharding: ShardingType = ShardingType.TABLE_WISE  # every table, when plan.strategy = "none"
    forward_codec: str = "fp32"  # wire format of pooled embeddings: fp32 | fp16 | bf16
    backward_codec: str = "fp32"  # wire format of their gradients
    pipeline: bool = False  # overlap the next batch's input_dist with this batch's compute
    timeout_s: float = 300.0  # a collective waiting longer for a peer fails the run
    # DMT on several hosts: tower t's tables inside host t (one of TOWER_SHARDINGS)
    tower_sharding: ShardingType = ShardingType.ROW_WISE

    def __post_init__(self) -> None:
        _choice(str(self.sharding), tuple(t.value for t in ShardingType), "distributed.sharding")
        object.__setattr__(self, "sharding", ShardingType(self.sharding))
        _choice(self.forward_codec, ("fp32", "fp16", "bf16"), "distributed.forward_codec")
        _choice(self.backward_codec, ("fp32", "fp16", "bf16"), "distributed.backward_codec")
        if not self.timeout_s > 0:
            raise ValueError(f"distributed.timeout_s must be > 0, got {self.timeout_s}")
        _choice(
            str(self.tower_sharding),
            tuple(t.value for t in TOWER_SHARDINGS),
            "distributed.tower_sharding",
        )
        object.__setattr__(self, "tower_sharding", ShardingType(self.tower_sharding))


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    nas: NASConfig = field(default_factory=NASConfig)  # towerrec nas search

    def __post_init__(self) -> None:
        if self.train.epochs is not None and self.data.source == "synthetic":
            raise ValueError(
                "train.epochs counts passes over a data set's training rows, but "
                "data.source = 'synthetic' is an endless stream; set train.steps instead"
            )
        if self.train.eval_every == "epoch" and self.data.source == "synthetic":
            raise ValueError(
                "train.eval_every = 'epoch', but data.source = 'synthetic' is an endless stream "
                "without epochs; give train.eval_every a number of steps"
            )
        periodic = self.train.eval_every != 0
        if self.train.early_stopping.patience and not periodic:
            raise ValueError(
                "train.early_stopping.patience is set but train.eval_every = 0 validates only "
                "at the end, so nothing could stop early; set train.eval_every to a number "
                "of steps or 'epoch'"
            )
        if self.optimizer.decay == "plateau" and not periodic:
            raise ValueError(
                "optimizer.decay = 'plateau' lowers the LR when validation stops improving, "
                "but train.eval_every = 0 validates only at the end; set train.eval_every to "
                "a number of steps or 'epoch'"
            )


# ------------------------------------------------------------------ loading
