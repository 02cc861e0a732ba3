"""One training step and one evaluation, on any layout of the model.

``train_step``: forward to logits, the loss (outside the model: BCE by default, or
another ``loss.kind``'s ``Objective`` from ``loss.py``), backward (the
fused embedding optimizer updates the looked-up rows inside backward), dense
optimizer step. ``evaluate``: metrics over this rank's batches, or over every
rank's when a run context is given. The loop around them is ``trainer.py``;
the DMT pilot run (``towers.py``) uses them too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from towerrec.config import Config
from towerrec.data.batch import Batch
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.train.distributed import RunContext
from towerrec.train.loss import BCE, TrainObjective
from towerrec.train.metrics import EvalMetrics, compute_metrics

__all__ = ["autocast", "evaluate", "set_learning_rates", "train_step"]


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
    ctx: RunContext | None = None,
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
