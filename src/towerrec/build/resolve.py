"""Settings a run resolves once, from its config and data, before it is built: the
device, the number of steps (and a short run's warm-up), the steps between validations."""

from __future__ import annotations

from dataclasses import replace

import torch

from towerrec.config import Config, OptimizerConfig
from towerrec.data.registry import SOURCES

__all__ = [
    "SYNTHETIC_STEPS",
    "resolve_device",
    "resolve_eval_every",
    "resolve_run_config",
    "resolve_steps",
]

SYNTHETIC_STEPS = 2500  # train.steps unset on an endless stream (the synthetic one)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device = {name!r} but CUDA is not available; use cpu or auto")
    return device


def resolve_steps(config: Config, source) -> tuple[int, str]:
    """The run's number of steps, and where it comes from.

    ``train.steps`` if set; else ``train.epochs`` (default 1: one epoch on real
    data, as MLPerf trains Criteo) passes over the source's training rows, rounded
    up to whole global batches; else, on the synthetic stream, 2,500 steps.
    """
    cfg = config.train
    if cfg.steps is not None:
        return cfg.steps, "as train.steps sets it"
    if SOURCES[config.data.source].endless:
        return SYNTHETIC_STEPS, f"the {config.data.source} data's default (train.steps unset)"
    epochs = cfg.epochs if cfg.epochs is not None else 1.0
    rows = source.train_rows
    samples = max(1, round(epochs * rows))
    steps = -(-samples // cfg.batch_size)
    why = (
        "train.epochs"
        if cfg.epochs is not None
        else "train.steps and train.epochs unset: one epoch on real data, as MLPerf trains "
        "Criteo; set either to change it"
    )
    return steps, (
        f"{epochs:g} epoch(s) of {rows:,} training rows at a global batch of "
        f"{cfg.batch_size:,}, rounded up to whole steps ({why})"
    )


def resolve_run_config(config: Config, source) -> tuple[Config, str]:
    """``config`` with ``train.steps`` resolved (``resolve_steps``) and ``train.epochs``
    cleared: what a run records as its ``config.toml``; and where the steps come from.

    A run sized from its data (``train.steps`` unset) that is too short for the default
    warm-up gets a tenth of its steps as warm-up instead: a small cache's one epoch of
    15 steps would otherwise end before the learning rate got anywhere."""
    steps, steps_from = resolve_steps(config, source)
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
    train = replace(config.train, steps=steps, epochs=None)
    return replace(config, train=train, optimizer=optimizer), steps_from


def resolve_eval_every(config: Config, source) -> int:
    """Steps between validations: ``train.eval_every``, or the steps of one pass over the
    training rows (rounded up) for ``"epoch"``; 0: only at the end of the run."""
    every = config.train.eval_every
    if every == "epoch":
        return -(-source.train_rows // config.train.batch_size)
    assert isinstance(every, int)  # TrainConfig allows only "epoch" as a string
    return every
