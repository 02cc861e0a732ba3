"""Teacher logits in process: ``TeacherPeriods``, the stand-in for the augmentation
service (``augment.py``) in tests and benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from towerrec.data.batch import Batch, DataSchema
from towerrec.data.periods import PeriodSource

__all__ = ["TeacherPeriods"]


class TeacherPeriods:
    """A ``PeriodSource`` whose batches carry a teacher's logits: ``teacher(period)``
    (a model, e.g. one trained some periods before) scores every batch of ``period``
    in eval mode. The in-process stand-in for the augmentation service."""

    def __init__(
        self,
        source: PeriodSource,
        teacher: Callable[[int], nn.Module],
        device: torch.device | None = None,
    ) -> None:
        self.source = source
        self.teacher = teacher
        self.device = device or torch.device("cpu")

    @property
    def schema(self) -> DataSchema:
        return self.source.schema

    @property
    def num_periods(self) -> int:
        return self.source.num_periods

    def period_rows(self, period: int) -> int:
        return self.source.period_rows(period)

    @torch.no_grad()
    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        model = self.teacher(period)
        was_training = model.training
        model.eval()
        try:
            for batch in self.source.period_batches(period, batch_size, rank, world_size):
                on = batch.to(self.device)
                logits = model(on.dense, on.sparse).float().cpu()
                yield replace(batch, teacher_logits=logits, validate=False)
        finally:
            model.train(was_training)

    def period_oracle(self, period: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self.source.period_oracle(period)
