"""The config sections of how a run trains: the dense optimizer, the loop, early stopping,
growth and pruning, and the loss. Each validates its own values (``ConfigError`` names
the key and the fix); ``sections.py`` holds the others and the whole ``Config``."""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

from towerrec.config.errors import choice as _choice
from towerrec.optim.dance import DanceSettings
from towerrec.optim.pb_lbfgs import PBLBFGSSettings
from towerrec.optim.shampoo import ShampooSettings
from towerrec.utils import at_least, positive, within

__all__ = [
    "GENERATOR_ALIASES",
    "EarlyStoppingConfig",
    "LossConfig",
    "OptimizerConfig",
    "PruneGrowConfig",
    "TemporalConfig",
    "TrainConfig",
]


@dataclass(frozen=True)
class OptimizerConfig:
    """The dense optimizer and the learning-rate schedule (applied to embeddings too)."""

    name: str = "adam"
    lr: float = 2e-3
    weight_decay: float = (
        0.0  # adam, shampoo: decoupled (AdamW); adagrad, sgd: L2 added to the gradient
    )
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 100
    decay: str = "cosine"  # none | linear | cosine | plateau, after warm-up
    min_lr_ratio: float = 0.1  # the lowest LR factor of every decay
    # plateau: the LR factor is multiplied by plateau_factor after plateau_patience
    # validations in a row without improving train.early_stopping.metric
    plateau_factor: float = 0.5
    plateau_patience: int = 2
    shampoo: ShampooSettings = field(default_factory=ShampooSettings)  # name = "shampoo"
    # name = "pb_lbfgs" | "dance": methods that draw their own (growing) samples
    # (optim/pb_lbfgs.py, optim/dance.py); the schedule's factor scales their steps
    pb_lbfgs: PBLBFGSSettings = field(default_factory=PBLBFGSSettings)
    dance: DanceSettings = field(default_factory=DanceSettings)

    @property
    def draws_samples(self) -> bool:
        """Whether the dense optimizer draws its own samples (``SampledOptimizer``)."""
        return self.name in ("pb_lbfgs", "dance")

    def __post_init__(self) -> None:
        _choice(
            self.name, ("adam", "adagrad", "sgd", "shampoo", "pb_lbfgs", "dance"), "optimizer.name"
        )
        _choice(self.decay, ("none", "linear", "cosine", "plateau"), "optimizer.decay")
        within("optimizer.plateau_factor", self.plateau_factor, "(0, 1)")
        at_least("optimizer.plateau_patience", self.plateau_patience, 1)
        positive("optimizer.lr", self.lr)
        at_least("optimizer.weight_decay", self.weight_decay, 0, hint="0 = none, e.g. 0.01")
        at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        within("optimizer.min_lr_ratio", self.min_lr_ratio, "[0, 1]")


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
        at_least("train.early_stopping.patience", self.patience, 0, hint="0: off")
        at_least("train.early_stopping.min_delta", self.min_delta, 0)


@dataclass(frozen=True)
class PruneGrowConfig:
    """``train.prune_grow``: alternate pruned and full-width phases of the hidden layers of
    the MLPs named in ``mlps`` (``workflows/prune_grow.py``). Pruned phase ``i`` runs from
    ``prune_at[i]`` to ``grow_at[i]`` (fractions of ``train.steps``, or steps with
    ``unit = "step"``) and keeps ``keep`` of each hidden layer's units; every pruned phase
    ends in growth, so the run ends full-size. ``mlps`` empty: off."""

    mlps: tuple[str, ...] = ()  # "top" and/or "bottom"
    keep: float = 0.5  # share of each hidden layer's units kept while pruned, in (0, 1]
    prune_at: tuple[float, ...] = ()
    grow_at: tuple[float, ...] = ()
    unit: str = "fraction"  # fraction (of train.steps) | step

    def __post_init__(self) -> None:
        key = "train.prune_grow"
        _choice(self.unit, ("fraction", "step"), f"{key}.unit")
        for name in self.mlps:
            _choice(name, ("top", "bottom"), f"{key}.mlps[...]")
        if len(set(self.mlps)) != len(self.mlps):
            raise ValueError(f"{key}.mlps = {list(self.mlps)} names an MLP twice")
        if not 0 < self.keep <= 1:
            raise ValueError(
                f"{key}.keep = {self.keep} must lie in (0, 1]: the share of hidden units a "
                "pruned phase keeps (e.g. 0.5)"
            )
        if not self.mlps:
            if self.prune_at or self.grow_at:
                raise ValueError(
                    f"{key}.prune_at/grow_at are set but {key}.mlps is empty; name the MLPs "
                    'to prune, e.g. mlps = ["top"]'
                )
            return
        if not self.prune_at:
            raise ValueError(f"{key}.mlps is set but prune_at is empty; e.g. prune_at = [0.1]")
        if len(self.grow_at) != len(self.prune_at):
            raise ValueError(
                f"{key} has {len(self.prune_at)} prune_at and {len(self.grow_at)} grow_at: "
                "every pruned phase must end in a growth phase so that the run ends "
                "full-size; give one grow_at after each prune_at"
            )
        points = [p for pair in zip(self.prune_at, self.grow_at, strict=True) for p in pair]
        if any(b <= a for a, b in itertools.pairwise(points)):
            raise ValueError(
                f"{key}: prune_at {list(self.prune_at)} and grow_at {list(self.grow_at)} must "
                "alternate in increasing order (prune_at[0] < grow_at[0] < prune_at[1] < ...)"
            )
        if self.unit == "fraction" and not (points[0] > 0 and points[-1] < 1):
            raise ValueError(
                f"{key}: with unit = 'fraction' every boundary must lie in (0, 1) of the run "
                f"(got {points}); the last growth needs steps after it to train the full model"
            )
        if self.unit == "step" and not all(p >= 1 and float(p).is_integer() for p in points):
            raise ValueError(f"{key}: with unit = 'step' every boundary is a whole step >= 1")

    @property
    def enabled(self) -> bool:
        return bool(self.mlps)


GENERATORS = ("mlp", "linear", "none")
GENERATOR_ALIASES: dict[bool, str] = {False: "none"}  # fgd_generator = false: no forecast


@dataclass(frozen=True)
class TemporalConfig:
    """``train.temporal``: how ``towerrec replay`` trains through time-ordered periods
    (``workflows/replay/temporal.py``, docs/temporal.md).

    ``strategy``: ``incremental`` (one pass over each new period, from the previous
    model), ``batch`` (at period t, one pass over periods ``t-window+1 .. t``; ``window``
    0 keeps them all, so the work grows with t) or ``fgd`` (future gradient descent: each
    dense gradient is replaced by a forecast of the next period's, from a small generator
    meta-learned on past periods). ``fgd_generator``: ``mlp`` (a coordinate-wise network
    of ``fgd_hidden`` hidden units), ``linear`` (two coefficients per dense tensor) or
    ``none`` (no forecast: fgd trains as incremental). ``fgd_meta_batches``: look-ahead
    batch pairs of the generator's meta-update at the start of each period;
    ``fgd_meta_lr``: the linear coefficients' step; ``fgd_net_lr``: Adam's learning rate
    on the mlp network (either 0: no meta-update); ``fgd_lookahead_lr``: the look-ahead's
    SGD step (0: the current dense learning rate); ``fgd_max_coef``: the
    bound on the linear coefficients, and on the network's correction in units of the
    gradient's RMS."""

    strategy: str = "incremental"  # incremental | batch | fgd
    window: int = 0  # periods a batch update trains on; 0 = all seen so far
    fgd_meta_batches: int = 8
    fgd_meta_lr: float = 0.1  # linear: the coefficients' step
    fgd_max_coef: float = 2.0
    fgd_generator: str | bool = "linear"  # mlp | linear | none (false: none)
    fgd_hidden: int = 16
    fgd_net_lr: float = 0.001  # mlp: Adam's learning rate on the network
    fgd_lookahead_lr: float = 0.0  # the look-ahead's SGD step; 0: the current dense LR

    def __post_init__(self) -> None:
        key = "train.temporal"
        _choice(self.strategy, ("incremental", "batch", "fgd"), f"{key}.strategy")
        if self.window < 0:
            raise ValueError(
                f"{key}.window = {self.window} must be >= 0: the number of latest periods a "
                "batch update trains on (0 = all seen so far)"
            )
        if self.window and self.strategy != "batch":
            raise ValueError(
                f"{key}.window = {self.window} applies to strategy = 'batch' only (strategy is "
                f"{self.strategy!r}); set strategy = 'batch' or drop the window"
            )
        at_least(f"{key}.fgd_meta_batches", self.fgd_meta_batches, 0)
        if isinstance(self.fgd_generator, bool) and self.fgd_generator in GENERATOR_ALIASES:
            object.__setattr__(self, "fgd_generator", GENERATOR_ALIASES[self.fgd_generator])
        if not isinstance(self.fgd_generator, str) or self.fgd_generator not in GENERATORS:
            raise ValueError(
                f"{key}.fgd_generator = {self.fgd_generator!r} is not one of "
                f"{', '.join(repr(g) for g in GENERATORS)} (mlp: a small network, linear: two "
                "coefficients per dense tensor, none: no forecast)"
            )
        at_least(f"{key}.fgd_meta_lr", self.fgd_meta_lr, 0)
        at_least(
            f"{key}.fgd_net_lr",
            self.fgd_net_lr,
            0,
            hint="Adam's learning rate on the mlp generator, e.g. 0.001; 0: no meta-update",
        )
        at_least(
            f"{key}.fgd_lookahead_lr",
            self.fgd_lookahead_lr,
            0,
            hint="0: the current dense learning rate",
        )
        at_least(
            f"{key}.fgd_hidden",
            self.fgd_hidden,
            1,
            hint="hidden units of the mlp generator, e.g. 16",
        )
        positive(
            f"{key}.fgd_max_coef",
            self.fgd_max_coef,
            hint="the bound on the generator's coefficients, e.g. 2.0",
        )

    @property
    def meta_lr(self) -> float:
        """The meta step of the chosen generator: ``fgd_net_lr`` (mlp) or ``fgd_meta_lr``."""
        return self.fgd_net_lr if self.fgd_generator == "mlp" else self.fgd_meta_lr


@dataclass(frozen=True)
class TrainConfig:
    """``steps`` global batches, or ``epochs`` passes over a data set's training rows
    (one of the two). Neither set: 2,500 steps on synthetic data, one epoch on real
    data (``build/resolve.py``, ``resolve_steps``)."""

    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 2048
    eval_every: int | str = 500  # steps between validations, or "epoch"; 0: only at the end
    eval_batch_size: int = 16384
    log_every: int = 50
    checkpoint_every: int = 0  # 0: only at the end of the run
    keep_checkpoints: int = 2
    verify_checkpoints: bool = True  # check a checkpoint's checksums before loading it
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = (
        0  # intra-op threads per rank; 0 = the cores (OMP_NUM_THREADS or affinity) / local ranks
    )
    progress: bool = True
    # fp32 | bf16 (autocast of the dense part, fp32 master weights) | auto: bf16 where the
    # device has bf16 units and a timed step confirms it is faster (build/choices.py)
    precision: str = "auto"
    tensorboard: bool = False  # TensorBoard event files beside metrics.jsonl (extra: tensorboard)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    prune_grow: PruneGrowConfig = field(default_factory=PruneGrowConfig)
    temporal: TemporalConfig = field(default_factory=TemporalConfig)

    def __post_init__(self) -> None:
        _choice(self.precision, ("fp32", "bf16", "auto"), "train.precision")
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
        positive("train.epochs", self.epochs)
        for key in ("steps", "batch_size", "eval_batch_size", "log_every"):
            at_least(f"train.{key}", getattr(self, key), 1)
        for key in ("eval_every", "checkpoint_every", "threads"):
            if isinstance(getattr(self, key), int):  # eval_every may be "epoch"
                at_least(f"train.{key}", getattr(self, key), 0)
        if self.keep_checkpoints < 1:
            raise ValueError("train.keep_checkpoints must be >= 1")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"train.device = {self.device!r}; use auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class LossConfig:
    """``loss``: the training objective (``train/loss.py``; docs/pu_learning.md).

    ``kind``: ``bce`` (labels at face value), ``pu_bce`` or ``punce`` (labels 0 are
    unlabelled, not negative). ``class_prior``: for the PU kinds, the share of positives
    among the unlabelled training examples, in (0, 1), or ``"estimate"``: estimated from
    the training data before training (``towerrec data pu-prior``). ``punce`` adds
    ``contrastive_weight`` times the contrastive term at ``temperature``.
    """

    kind: str = "bce"  # bce | pu_bce | punce
    class_prior: float | str | None = None
    contrastive_weight: float = 0.1
    temperature: float = 0.5

    def __post_init__(self) -> None:
        _choice(self.kind, ("bce", "pu_bce", "punce"), "loss.kind")
        prior = self.class_prior
        if isinstance(prior, str) and prior != "estimate":
            raise ValueError(f'loss.class_prior = {prior!r}: give a number in (0, 1) or "estimate"')
        if isinstance(prior, int | float) and not 0 < prior < 1:
            raise ValueError(
                f"loss.class_prior = {prior} must lie strictly between 0 and 1 (the share of "
                'positives among the unlabelled examples), or be "estimate"'
            )
        if self.kind != "bce" and prior is None:
            raise ValueError(
                f"loss.kind = {self.kind!r} needs loss.class_prior: the share of positives "
                'among the unlabelled training examples (e.g. 0.3), or "estimate" to '
                "estimate it from the training data (`towerrec data pu-prior` shows it)"
            )
        if self.kind == "bce" and prior is not None:
            warnings.warn(
                "loss.class_prior is ignored: loss.kind = 'bce' takes labels at face value "
                "(set loss.kind = 'pu_bce' or 'punce' to use it)",
                stacklevel=2,
            )
        at_least("loss.contrastive_weight", self.contrastive_weight, 0)
        positive("loss.temperature", self.temperature)
