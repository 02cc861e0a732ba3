"""Settings a run resolves once, from its config and data, before it is built: the
device, the number of steps (and a short run's warm-up), the steps between validations."""

from __future__ import annotations

from dataclasses import replace

import torch

from towerrec.config import Config, EmbeddingConfig, OptimizerConfig, TrainConfig
from towerrec.config.recipes import large_vocabulary
from towerrec.data.registry import SOURCES

__all__ = [
    "CONVERGE_EPOCHS",
    "CONVERGE_MAX_ROWS",
    "CONVERGE_PATIENCE",
    "SYNTHETIC_STEPS",
    "converges",
    "embedding_rule_warning",
    "resolve_device",
    "resolve_eval_every",
    "resolve_run_config",
    "resolve_steps",
]

SYNTHETIC_STEPS = 2500  # train.steps unset on an endless stream (the synthetic one)
# train.steps and train.epochs unset on real data: train to convergence (early stopping,
# at most CONVERGE_EPOCHS epochs) up to CONVERGE_MAX_ROWS training rows; one pass above.
# 10M rows: an epoch of a few minutes on one GPU, so that the cap is at most about an hour.
CONVERGE_EPOCHS = 20
CONVERGE_MAX_ROWS = 10_000_000
CONVERGE_PATIENCE = 2  # validations without improvement before stopping


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device = {name!r} but CUDA is not available; use cpu or auto")
    return device


def resolve_steps(config: Config, source) -> tuple[int, str]:
    """The run's number of steps, and where it comes from.

    ``train.steps`` if set; else ``train.epochs`` passes over the source's training
    rows, rounded up to whole global batches; else, on the synthetic stream, 2,500
    steps; else (real data, neither set) ``CONVERGE_EPOCHS`` epochs as a cap that early
    stopping ends (``converges``), or one epoch of a data set of more than
    ``CONVERGE_MAX_ROWS`` training rows.
    """
    cfg = config.train
    if cfg.steps is not None:
        return cfg.steps, "as train.steps sets it"
    if SOURCES[config.data.source].endless:
        return SYNTHETIC_STEPS, f"the {config.data.source} data's default (train.steps unset)"
    rows = source.train_rows
    if cfg.epochs is not None:
        epochs, why = cfg.epochs, "train.epochs"
    elif converges(config, source):
        epochs = float(CONVERGE_EPOCHS)
        why = (
            f"train.steps and train.epochs unset on {rows:,} training rows (at most "
            f"{CONVERGE_MAX_ROWS:,}): up to {CONVERGE_EPOCHS} epochs, until validation stops "
            "improving; set either to choose"
        )
    else:
        epochs = 1.0
        why = (
            f"train.steps and train.epochs unset on more than {CONVERGE_MAX_ROWS:,} training "
            "rows: one pass, as MLPerf trains Criteo; set either to choose"
        )
    samples = max(1, round(epochs * rows))
    steps = -(-samples // cfg.batch_size)
    return steps, (
        f"{epochs:g} epoch(s) of {rows:,} training rows at a global batch of "
        f"{cfg.batch_size:,}, rounded up to whole steps ({why})"
    )


def converges(config: Config, source) -> bool:
    """Whether a run trains to convergence by default: real data of at most
    ``CONVERGE_MAX_ROWS`` training rows with neither ``train.steps`` nor ``train.epochs``
    set."""
    cfg = config.train
    return (
        cfg.steps is None
        and cfg.epochs is None
        and not SOURCES[config.data.source].endless
        and source.train_rows <= CONVERGE_MAX_ROWS
    )


def _converge_settings(config: Config) -> tuple[TrainConfig, str]:
    """``config.train`` with what a run to convergence needs where the config leaves the
    defaults: a validation every epoch, and early stopping with ``CONVERGE_PATIENCE``
    (not under growth and pruning, which must end full-size, nor with validations only at
    the end: train.eval_every = 0)."""
    cfg, notes = config.train, []
    if cfg.eval_every == TrainConfig().eval_every:
        cfg = replace(cfg, eval_every="epoch")
        notes.append('train.eval_every = "epoch"')
    if cfg.early_stopping.patience == 0 and cfg.eval_every != 0 and not cfg.prune_grow.enabled:
        stop = replace(cfg.early_stopping, patience=CONVERGE_PATIENCE)
        cfg = replace(cfg, early_stopping=stop)
        notes.append(
            f"train.early_stopping.patience = {CONVERGE_PATIENCE} (on validation "
            f"{stop.metric}; the best weights are kept)"
        )
    return cfg, "; ".join(notes)


def resolve_run_config(config: Config, source) -> tuple[Config, str]:
    """``config`` with ``train.steps`` resolved (``resolve_steps``) and ``train.epochs``
    cleared (with ``_converge_settings`` for a run to convergence): what a run records as
    its ``config.toml``; and where the steps come from.

    A run sized from its data (``train.steps`` unset) of fewer than ten times the default
    warm-up's steps gets a tenth of its steps as warm-up instead: a small cache's one
    epoch of 15 steps would otherwise end before the learning rate got anywhere."""
    steps, steps_from = resolve_steps(config, source)
    train = config.train
    if converges(config, source):
        train, notes = _converge_settings(config)
        if notes:
            steps_from += f"; {notes}"
    optimizer = config.optimizer
    warmup = max(1, steps // 10)
    if (
        config.train.steps is None
        and optimizer.warmup_steps == OptimizerConfig().warmup_steps
        and optimizer.warmup_steps > warmup
    ):
        optimizer = replace(optimizer, warmup_steps=warmup)
        steps_from += (
            f"; optimizer.warmup_steps {config.optimizer.warmup_steps} -> {warmup}, a tenth "
            "of this run (set optimizer.warmup_steps to choose)"
        )
    train = replace(train, steps=steps, epochs=None)
    return replace(config, train=train, optimizer=optimizer), steps_from


def resolve_eval_every(config: Config, source) -> int:
    """Steps between validations: ``train.eval_every``, or the steps of one pass over the
    training rows (rounded up) for ``"epoch"``; 0: only at the end of the run."""
    every = config.train.eval_every
    if every == "epoch":
        return -(-source.train_rows // config.train.batch_size)
    assert isinstance(every, int)  # TrainConfig allows only "epoch" as a string
    return every


def embedding_rule_warning(config: Config, schema, train_rows: int | None) -> str | None:
    """What to say when the defaults' embedding rule (row-wise Adagrad at 0.5 on rows
    started normal 0.01, measured best on small vocabularies) trains real data of a large
    vocabulary (``recipes.large_vocabulary``: a table above 50,000 rows, or few training
    lookups per table row), where it scored 0.018 test AUC below a plain DLRM on FuxiCTR's
    rule (docs/benchmarks.md, "Large vocabularies"); None otherwise."""
    if SOURCES[config.data.source].endless:
        return None
    rule = ("optimizer", "lr", "init", "init_scale")
    defaults = EmbeddingConfig()
    if any(getattr(config.embedding, k) != getattr(defaults, k) for k in rule):
        return None
    sizes = [f.num_embeddings for f in schema.sparse]
    large = large_vocabulary(sizes, [f.pooling_factor for f in schema.sparse], train_rows)
    if large is None:
        return None
    return (
        f"a large vocabulary ({large}) trains with the defaults' embedding rule, row-wise "
        "Adagrad 0.5 on rows started normal 0.01, which fits the rare rows' noise: on such "
        "data it scored 0.018 test AUC below a plain DLRM on FuxiCTR's rule (Adam 1e-3 on "
        "rows started normal 1e-4); `--config criteo` trains with that rule (add --set "
        "'model.bottom_mlp=[]' without dense features), as `towerrec data libfm | table` "
        "print for such data (docs/data.md)"
    )
