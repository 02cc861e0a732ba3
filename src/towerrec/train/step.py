"""The step primitives: one training step and one evaluation, on any layout of the model,
and the learning-rate schedule around them.

``train_step``: forward to logits, the loss (outside the model: BCE by default, or
another ``loss.kind``'s ``Objective`` from ``loss.py``), backward (the
fused embedding optimizer updates the looked-up rows inside backward), dense
optimizer step. ``evaluate``: metrics over this rank's batches, or over every
rank's when a group of ranks is given. ``lr_factor`` and ``set_learning_rates``:
the schedule. ``fit_steps``: a short run of plain steps.

The bottom of the engine: the loop (``loop.py``) runs them, and so do the build
layer's DMT pilot (``towerrec.build.towers``) and the workflows; this module, the
objective (``loss.py``) and the metrics (``metrics.py``) import nothing else of
``towerrec.train`` (tests/test_layering.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from towerrec.config import Config, OptimizerConfig
from towerrec.data.batch import Batch
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.train.loss import BCE, TrainObjective
from towerrec.train.metrics import EvalMetrics, compute_metrics

__all__ = [
    "RankGroup",
    "autocast",
    "autocast_dtype",
    "evaluate",
    "fit_steps",
    "lr_factor",
    "set_learning_rates",
    "train_step",
]


AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


class RankGroup(Protocol):
    """The ranks an evaluation spans (``RunContext``, ``train/distributed.py``)."""

    @property
    def world_size(self) -> int: ...

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (a collective)."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The concatenation over ranks of 1-D tensors, in rank order (a collective)."""
        ...


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved ``train.precision`` (``fp32``: None, no autocast)."""
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(
            f"train.precision = {precision!r} is not resolved: build the run with "
            "towerrec.build.run.build_run (or towerrec.build.choices.resolve_choices), "
            "which resolves 'auto' to fp32 or bf16"
        )
    return AUTOCAST_DTYPES[precision]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision for the dense part (``dtype`` None: off). Weights stay fp32
    (the master copy); matmuls run in ``dtype``; embedding lookups are not autocast."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    autocast_dtype: torch.dtype | None = None,
    objective: TrainObjective | None = None,
) -> torch.Tensor:
    objective = objective or BCE
    with autocast(batch.dense.device, autocast_dtype):
        logits, extra = objective.forward(model, batch)
    loss = objective.loss(logits, extra, batch.labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # embedding rows are updated here, inside backward
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    ctx: RankGroup | None = None,
    padding: Batch | None = None,
) -> EvalMetrics:
    """Metrics over ``batches`` of this rank, or of every rank of ``ctx``.

    A sharded model runs collectives in forward, so on several ranks every rank
    runs the same number of forwards: a rank whose batches ran out (its slice of
    the eval split is shorter, or its last batch came sooner) forwards
    ``padding`` and drops those predictions until no rank has batches left.
    Every rank's predictions are then gathered, so the metrics are those of the
    whole eval split.
    """
    group = ctx if ctx is not None and ctx.world_size > 1 else None
    if group is not None and padding is None:
        raise ValueError("evaluate on several ranks needs a padding batch")
    was_training = model.training
    model.eval()
    probs, labels = [], []
    remaining = iter(batches)
    while True:
        batch = next(remaining, None)
        if not (group.any_rank(batch is not None) if group is not None else batch is not None):
            break
        with autocast(device, autocast_dtype):
            forward = batch if batch is not None else padding
            assert forward is not None  # checked above: several ranks come with a padding batch
            forward = forward.to(device)
            logits = model(forward.dense, forward.sparse)
        if batch is not None:
            probs.append(torch.sigmoid(logits.float()).cpu())
            labels.append(batch.labels.cpu())
    model.train(was_training)
    probs = torch.cat(probs) if probs else torch.zeros(0)
    labels = torch.cat(labels) if labels else torch.zeros(0)
    if group is not None:
        probs, labels = group.gather(probs), group.gather(labels)
    return compute_metrics(probs, labels)


def set_learning_rates(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: Config, factor: float
) -> None:
    for group in optimizer.param_groups:  # a group with its own base_lr: the adapter's
        group["lr"] = group.get("base_lr", config.optimizer.lr) * factor
    for _, module in fused_embedding_modules(model):
        module.set_learning_rate(config.embedding.lr * factor)


def lr_factor(config: OptimizerConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base learning rates at 1-based ``step``: linear warm-up, then decay
    (``plateau``: 1 here; the trainer multiplies in the factor its validations set)."""
    if config.warmup_steps and step <= config.warmup_steps:
        return step / config.warmup_steps
    if config.decay in ("none", "plateau"):
        return 1.0
    span = max(total_steps - config.warmup_steps, 1)
    progress = min(max(step - config.warmup_steps, 0) / span, 1.0)
    floor = config.min_lr_ratio
    if config.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def fit_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    batches: Iterator[Batch],
    steps: int,
    device: torch.device,
) -> None:
    """``steps`` plain steps (BCE) on the next ``steps`` of ``batches``, at the schedule of
    ``config.optimizer`` over those steps: the short runs of the DMT pilot and of the PU
    prior's classifiers."""
    for step in range(1, steps + 1):
        set_learning_rates(model, optimizer, config, lr_factor(config.optimizer, step, steps))
        train_step(model, optimizer, next(batches).to(device))
