"""The config sections: one frozen dataclass per component, each validating its own
values (``ConfigError`` names the key and the fix; the training sections are in
``training.py``, ``[embedding]`` in ``embedding.py``), the whole ``Config`` with the
checks across sections, and ``RESUME_SAFE_KEYS``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from towerrec.config.embedding import EmbeddingConfig
from towerrec.config.errors import ConfigError
from towerrec.config.errors import choice as _choice
from towerrec.config.nas import NASConfig
from towerrec.config.training import (
    GENERATOR_ALIASES,
    EarlyStoppingConfig,
    LossConfig,
    OptimizerConfig,
    PruneGrowConfig,
    TemporalConfig,
    TrainConfig,
)
from towerrec.data.augmented import AugmentedConfig
from towerrec.data.loader import VERIFY_ALIASES, LoaderConfig
from towerrec.data.movielens import MovieLensConfig
from towerrec.data.registry import SOURCES
from towerrec.data.synthetic import SyntheticConfig
from towerrec.models.dcn import DCNConfig
from towerrec.models.dmt import DMTConfig
from towerrec.models.names import REPRESENTATION_MODELS, ModelName
from towerrec.models.wukong import WukongConfig
from towerrec.sharding import TOWER_SHARDINGS, ShardingType
from towerrec.utils import at_least, positive

__all__ = [
    "RESUME_SAFE_KEYS",
    "VALUE_ALIASES",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "DistributedConfig",
    "EarlyStoppingConfig",
    "EmbeddingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PlanConfig",
    "PruneGrowConfig",
    "TemporalConfig",
    "TrainConfig",
]

# Settings that take a documented second spelling of some values: key -> {written: read as}
# (a value so written is read as, and saved as, its other spelling)
VALUE_ALIASES: dict[str, dict[bool, str]] = {
    "data.loader.verify": VERIFY_ALIASES,
    "train.temporal.fgd_generator": GENERATOR_ALIASES,
}

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
    "train.verify_checkpoints",  # how a checkpoint is read, not what it holds
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
    "distributed.dense",  # DCP checkpoints load under ddp and fsdp alike
    "distributed.reshard_after_forward",
    "distributed.dedup_ids",  # the wire format of ids; the same rows arrive
    # where the tables' rows live: checkpoints hold full tables, training is bit-identical
    "embedding.memory",
    "embedding.cache_*",
    "embedding.backing",
    "embedding.backing_path",
    "embedding.prefetch",
    "embedding.write_behind",
    "embedding.ssd_reads",
    "embedding.tables.*.memory",
    "embedding.tables.*.cache_*",
    "embedding.tables.*.backing*",
    "embedding.tables.*.write_behind",
    "embedding.tables.*.ssd_reads",
    "plan.*",
)


@dataclass(frozen=True)
class DataConfig:
    """``source``: synthetic (built in), movielens (``path``: its directory, empty for the
    bundled one), criteo or cache (``path``: a cache written by ``towerrec data``),
    augmented (periods with teacher logits written by ``towerrec distill serve``;
    ``augmented.dir``; ``towerrec replay`` only)."""

    source: str = "synthetic"
    path: str = ""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    movielens: MovieLensConfig = field(default_factory=MovieLensConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    augmented: AugmentedConfig = field(default_factory=AugmentedConfig)

    def __post_init__(self) -> None:
        _choice(self.source, tuple(SOURCES), "data.source")
        SOURCES[self.source].check(self)  # what this source needs of the section


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
        _choice(self.name, tuple(n.value for n in ModelName), "model.name")
        at_least("model.embedding_dim", self.embedding_dim, 1)
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
class PlanConfig:
    """How embedding tables are sharded over ranks (``towerrec plan`` shows the result).

    ``strategy``: ``none`` (every table sharded the one way ``distributed.sharding``
    says), ``auto`` (plan from the data's statistics with ``planner``) or ``file``
    (the plan JSON at ``path``). A multi-process run plans for its own hosts and
    ranks; ``towerrec plan`` uses ``hosts`` and ``ranks_per_host`` (0: the world
    size over ``hosts``);
    ``device_memory_gib = 0`` the ``topology`` preset's; ``calibration`` is a
    cost-constants JSON written by ``towerrec plan --calibrate``;
    ``weights`` a learned planner's weights (``neuroshard``, ``dreamshard``,
    ``autoshard``; from ``towerrec plan train-policy``; empty: the weights shipped
    with towerrec).
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
    weights: str = ""

    def __post_init__(self) -> None:
        from towerrec.planner.search import PLANNERS
        from towerrec.planner.topology import PRESETS

        _choice(self.strategy, ("none", "auto", "file"), "plan.strategy")
        _choice(self.planner, tuple(PLANNERS), "plan.planner")
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
    # DMT on several hosts: the tower outputs, x (tower_dense) and their gradients on the
    # cross-host wire, both ways; bf16 rounds each float to 8 significant bits (relative
    # error <= 2^-8) with fp32's range; fp16 keeps 11 bits only for |x| >= 2^-14
    tower_codec: str = "bf16"
    pipeline: bool = False  # overlap the next batch's input_dist with this batch's compute
    timeout_s: float = 300.0  # a collective waiting longer for a peer fails the run
    # DMT on several hosts: tower t's tables inside host t; "auto": the planner's cost
    # model picks table-wise or row-wise per tower (planner/tower_layout.py), else one
    # of TOWER_SHARDINGS for every tower
    tower_sharding: str = "auto"
    # The dense parameters over the ranks: "ddp" replicates them, "fsdp" shards them
    # (FSDP2 fully_shard per layer; embeddings stay sharded by the plan)
    dense: str = "ddp"
    # fsdp: free each layer's gathered weights after its forward (gathered again for
    # backward); false keeps them until backward: one all-gather fewer, more memory
    reshard_after_forward: bool = True
    # ids on the wire: each key's unique ids once plus an inverse index, where smaller
    dedup_ids: bool = True
    # DDP's dense gradient all-reduce over all ranks: "hierarchical" (reduce-scatter
    # inside each host, all-reduce of each shard across hosts, all-gather inside:
    # 2/3 of the ring's cross-host bytes on 2 x 2; distributed/dense_allreduce.py) or
    # "ring" (one all-reduce); on one host (or one rank per host) always the ring;
    # unused under dense = "fsdp"
    dense_allreduce: str = "hierarchical"

    def __post_init__(self) -> None:
        _choice(str(self.sharding), tuple(t.value for t in ShardingType), "distributed.sharding")
        object.__setattr__(self, "sharding", ShardingType(self.sharding))
        _choice(self.forward_codec, ("fp32", "fp16", "bf16"), "distributed.forward_codec")
        _choice(self.backward_codec, ("fp32", "fp16", "bf16"), "distributed.backward_codec")
        _choice(self.tower_codec, ("fp32", "fp16", "bf16"), "distributed.tower_codec")
        positive("distributed.timeout_s", self.timeout_s)
        _choice(
            str(self.tower_sharding),
            ("auto", *(t.value for t in TOWER_SHARDINGS)),
            "distributed.tower_sharding",
        )
        object.__setattr__(self, "tower_sharding", str(self.tower_sharding))
        _choice(self.dense, ("ddp", "fsdp"), "distributed.dense")
        if not isinstance(self.dedup_ids, bool):
            raise ValueError(f"distributed.dedup_ids must be true or false, got {self.dedup_ids!r}")
        # (distributed.dense = "fsdp" reduce-scatters the gradients itself: no all-reduce)
        _choice(self.dense_allreduce, ("ring", "hierarchical"), "distributed.dense_allreduce")


@dataclass(frozen=True)
class DistillConfig:
    """``distill``: external distillation from a foundation model's logits carried by the
    batches (``Batch.teacher_logits``; ``workflows/distill/loss.py``, docs/exfm.md "Students").

    ``weight`` (w): the distillation loss's weight, 0 = off (then every other key is
    ignored, unless ``adapter``). ``head``: ``shared`` (the distillation loss on the serving
    logit) or ``auxiliary`` (on a separate head over the same representation; DLRM).
    ``label_scale`` (alpha): the teacher's logit is multiplied by it before the sigmoid that
    makes the soft label. ``grad_scale`` (beta): the auxiliary head's gradient into the
    shared backbone is multiplied by it. ``adapter``: a small MLP (``adapter_width``) on the
    teacher's logit (and the dense features, ``adapter_features``) trained on the labels
    at ``adapter_lr``, its output the distillation target (through a stop-gradient).
    ``adapter_order``: ``joint`` (the adapter learns each batch's labels in the student's
    step) or ``first`` (replay: before the student trains on a period, the adapter makes
    one pass of its own over that period's labels, then goes on learning jointly).
    """

    weight: float = 0.0
    head: str = "auxiliary"  # shared | auxiliary
    label_scale: float = 1.0
    grad_scale: float = 1.0
    adapter: bool = False
    adapter_width: int = 16
    adapter_lr: float = 1e-3
    adapter_features: bool = False  # the adapter reads the dense features besides the logit
    adapter_order: str = "joint"  # joint | first: a pass over each period's labels first

    def __post_init__(self) -> None:
        _choice(self.head, ("shared", "auxiliary"), "distill.head")
        _choice(self.adapter_order, ("joint", "first"), "distill.adapter_order")
        if not (self.weight >= 0 and self.weight < float("inf")):
            raise ValueError(
                f"distill.weight = {self.weight} must be a finite number >= 0 (0: no "
                "distillation loss)"
            )
        if not self.label_scale > 0:
            raise ValueError(
                f"distill.label_scale = {self.label_scale} must be > 0 (1: the teacher's "
                "probability as it is)"
            )
        if not self.grad_scale >= 0:
            raise ValueError(
                f"distill.grad_scale = {self.grad_scale} must be >= 0 (1: the auxiliary "
                "head's full gradient reaches the backbone, 0: none)"
            )
        at_least("distill.adapter_width", self.adapter_width, 1)
        positive("distill.adapter_lr", self.adapter_lr)
        if self.adapter and self.weight == 0:
            raise ValueError(
                "distill.adapter = true with distill.weight = 0: the adapter's output is the "
                "distillation target, and no loss would use it; set distill.weight > 0"
            )
        if self.adapter_order != "joint" and not self.adapter:
            raise ValueError(
                f"distill.adapter_order = {self.adapter_order!r} orders the adapter's training, "
                "but distill.adapter = false; set distill.adapter = true or leave adapter_order "
                "at 'joint'"
            )
        changed = [
            key
            for key in (
                "head",
                "label_scale",
                "grad_scale",
                "adapter_width",
                "adapter_lr",
                "adapter_order",
            )
            if getattr(self, key) != getattr(DistillConfig, key)
        ]
        if self.weight == 0 and changed:
            warnings.warn(
                f"distill.{', distill.'.join(changed)} ignored: distill.weight = 0 turns "
                "distillation off (set distill.weight > 0 to use them)",
                stacklevel=2,
            )
        if self.head == "shared" and self.grad_scale != 1.0:
            raise ValueError(
                f"distill.grad_scale = {self.grad_scale} acts on the auxiliary head's "
                "gradient, but distill.head = 'shared'; set distill.head = 'auxiliary' or "
                "leave grad_scale at 1"
            )

    @property
    def enabled(self) -> bool:
        return self.weight > 0


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    nas: NASConfig = field(default_factory=NASConfig)  # towerrec nas search
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        distill = self.distill
        if (
            distill.enabled
            and distill.head == "auxiliary"
            and self.model.name not in REPRESENTATION_MODELS
        ):
            raise ValueError(
                f"distill.head = 'auxiliary' needs a model with a representation; model.name "
                f"= {self.model.name!r} has none (the DLRM's is its top MLP's input): set "
                "model.name = 'dlrm' or distill.head = 'shared'"
            )
        if distill.enabled and self.optimizer.draws_samples:
            raise ValueError(
                f"distill.weight > 0 with optimizer.name = {self.optimizer.name!r}: it "
                "evaluates the plain log-loss on its samples; use adam, adagrad or sgd"
            )
        if self.loss.kind == "punce" and self.model.name not in REPRESENTATION_MODELS:
            raise ValueError(
                f"loss.kind = 'punce' needs a model with a representation; model.name = "
                f"{self.model.name!r} has none (the DLRM's is its top MLP's input): set "
                "model.name = 'dlrm' or loss.kind = 'pu_bce'"
            )
        endless = SOURCES[self.data.source].endless
        if self.train.epochs is not None and endless:
            raise ValueError(
                "train.epochs counts passes over a data set's training rows, but "
                f"data.source = {self.data.source!r} is an endless stream; set train.steps "
                "instead"
            )
        if self.train.eval_every == "epoch" and endless:
            raise ValueError(
                f"train.eval_every = 'epoch', but data.source = {self.data.source!r} is an "
                "endless stream without epochs; give train.eval_every a number of steps"
            )
        periodic = self.train.eval_every != 0
        if self.train.early_stopping.patience and not periodic:
            raise ValueError(
                "train.early_stopping.patience is set but train.eval_every = 0 validates only "
                "at the end, so nothing could stop early; set train.eval_every to a number "
                "of steps or 'epoch'"
            )
        if self.train.prune_grow.enabled and self.optimizer.name == "shampoo":
            raise ValueError(
                "train.prune_grow cannot be used with optimizer.name = 'shampoo': its "
                "preconditioner blocks do not slice along a hidden unit; use adam, adagrad or sgd"
            )
        if self.optimizer.draws_samples:
            name = self.optimizer.name
            if self.train.prune_grow.enabled:
                raise ValueError(
                    f"train.prune_grow with optimizer.name = {name!r}: its history and samples "
                    "are of the full-width parameters; use adam, adagrad or sgd"
                )
            if self.loss.kind != "bce":
                raise ValueError(
                    f"loss.kind = {self.loss.kind!r} with optimizer.name = {name!r}: it "
                    "evaluates the plain log-loss on its samples; use loss.kind = 'bce' or "
                    "another optimizer"
                )
            if self.distributed.dense == "fsdp":
                raise ValueError(
                    f"distributed.dense = 'fsdp' with optimizer.name = {name!r}: it sums its "
                    "ranks' gradients itself on whole parameters; use distributed.dense = 'ddp'"
                )
        pg = self.train.prune_grow
        if pg.enabled and self.train.early_stopping.patience:
            raise ValueError(
                "train.prune_grow with train.early_stopping.patience: the best weights could be "
                "a pruned phase's, and the run must end full-size; set patience = 0"
            )
        if pg.enabled and self.distributed.dense == "fsdp":
            raise ValueError(
                "train.prune_grow with distributed.dense = 'fsdp': a layer's width changes "
                "under FSDP's flat shards; use distributed.dense = 'ddp'"
            )
        if (
            pg.enabled
            and pg.unit == "step"
            and self.train.steps is not None
            and max(pg.grow_at) >= self.train.steps
        ):
            raise ValueError(
                f"train.prune_grow.grow_at ends at step {max(pg.grow_at):g}, not before "
                f"train.steps = {self.train.steps}: the run would end pruned; grow earlier"
            )
        if self.optimizer.decay == "plateau" and not periodic:
            raise ValueError(
                "optimizer.decay = 'plateau' lowers the LR when validation stops improving, "
                "but train.eval_every = 0 validates only at the end; set train.eval_every to "
                "a number of steps or 'epoch'"
            )


# ------------------------------------------------------------------ loading
