"""Typed run configuration: one dataclass per component, loaded from TOML.

A run's config is built from, in order: the defaults below, an optional TOML
file (``--config``), and ``--set section.key=value`` overrides (values in TOML
syntax; bare words are strings). Unknown keys and bad values raise
``ConfigError`` naming the key and the fix. ``config_to_toml`` writes the
resolved config back, so a run directory's ``config.toml`` reproduces the run.

A resumed run (``towerrec train --resume``) starts from that saved
``config.toml`` instead of the defaults; it may change only the settings in
``RESUME_SAFE_KEYS`` (``resume_changes`` refuses the rest).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import tomllib
import types
import typing
import warnings
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, cast

import tomli_w

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
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "resume_changes",
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
def _convert(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        errors = []
        for option in options:
            try:
                return _convert(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of settings, got {value!r}")
        return _build(cast(type, hint), value, key)  # a dataclass type hint, not an instance
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of named entries, got {value!r}")
        item = typing.get_args(hint)[1]
        return {str(k): _convert(v, item, f"{key}.{k}") for k, v in value.items()}
    if origin in (tuple, list):
        args = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        item = args[0] if args else Any
        items = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in hint)
            raise ConfigError(f"{key} = {value!r} is not one of {choices}") from None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown config key {full!r}{hint}; valid keys here: {', '.join(names)}"
            )
        kwargs[key] = _convert(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[{where or 'config'}] {e}") from None


def config_from_dict(data: dict[str, Any]) -> Config:
    return _build(Config, data, "")


def _parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.steps=100")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word: a string
    return key.split("."), value


def _read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; see configs/ for examples")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def _merge(into: dict[str, Any], data: dict[str, Any]) -> None:
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    base: str | Path | None = None,
) -> Config:
    """Defaults, then the TOML file at ``base`` (a resumed run's saved config.toml), then
    the TOML file at ``path``, then ``section.key=value`` overrides."""
    data: dict[str, Any] = {}
    for file in (base, path):
        if file is not None:
            _merge(data, _read_toml(file))
    for text in overrides:
        parts, value = _parse_override(text)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return config_from_dict(data)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_changes(saved: Config, config: Config) -> dict[str, dict[str, Any]]:
    """The settings ``config`` changes of a run's ``saved`` config, ``{key: {"from": saved
    value, "to": new value}}``; a ``ConfigError`` names every change not in
    ``RESUME_SAFE_KEYS``."""
    old, new = _flatten(config_to_dict(saved)), _flatten(config_to_dict(config))
    changed = {
        key: {"from": old.get(key), "to": new.get(key)}
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    }
    refused = [
        key
        for key in changed
        if not any(fnmatch.fnmatchcase(key, safe) for safe in RESUME_SAFE_KEYS)
    ]
    if refused:
        detail = ", ".join(
            f"{key} = {changed[key]['to']!r} (the run has {changed[key]['from']!r})"
            for key in refused
        )
        raise ConfigError(
            f"--resume continues the run with its saved config.toml; it cannot change {detail}. "
            f"Drop those --set/--config values, or start a new run with another --out "
            f"(a resume may change only {', '.join(RESUME_SAFE_KEYS)})"
        )
    return changed


# ------------------------------------------------------------------ writing
def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    return _plain(config)


def config_to_toml(config: Config) -> str:
    return tomli_w.dumps(config_to_dict(config))
