"""The interface of a data source, as the trainer uses it.

Implementations: ``SyntheticSource`` (a planted-truth stream: no row count, no
test split, an oracle) and ``ColumnSource`` (a cache or in-memory columns:
train, validation and test splits, no oracle).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from towerrec.data.batch import Batch, DataSchema

__all__ = ["DataSource", "RowAccessSource"]


@runtime_checkable
class DataSource(Protocol):
    """Batches of train, validation (``eval_batches``) and test splits, rank by rank."""

    @property
    def schema(self) -> DataSchema: ...

    @property
    def train_rows(self) -> int | None:
        """Rows of the training split; None for an endless stream."""
        ...

    @property
    def test_rows(self) -> int: ...

    def train_batches(
        self, batch_size: int, start_batch: int = 0, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]: ...

    def eval_batches(
        self, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]: ...

    def test_batches(
        self, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]: ...

    def eval_oracle(
        self, rank: int = 0, world_size: int = 1
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Labels and the true click probabilities of this rank's validation samples,
        for a source that knows them (a planted truth); None otherwise."""
        ...


@runtime_checkable
class RowAccessSource(Protocol):
    """A source whose training rows can be read by id (``ColumnSource``): what a
    cross-fitted estimate over the training split (``workflows/pu/prior.py``) needs."""

    @property
    def train_rows(self) -> int: ...

    def gather_train(self, rows: np.ndarray) -> Batch:
        """Batch of the given training rows (ids in ``[0, train_rows)``), in that order."""
        ...
