"""Time-ordered training data: periods, what ``towerrec replay`` trains through.

A period is a time slice of the training data. Periods come in time order and
together hold every row of the stream once, none twice::

    synthetic   data.synthetic.periods slices of period_samples stream samples,
                each labelled by its period's (drifting) teacher (synthetic.py)
    movielens   every rating sorted by timestamp, cut into data.movielens.periods
                slices of equal count (period_by = "count") or of equal calendar
                span (period_by = "calendar"; movielens.py)
    criteo      a cache of day files: each input file's training rows are one
                period, in the order the files were given (cache_periods)

Inside a period, rows keep their order. Global batch i of a period of n rows
holds rows ``[i*G, min((i+1)*G, n))``, G = batch_size * world_size; rank r of w
reads ``[lo + r*m//w, lo + (r+1)*m//w)`` of its m rows starting at lo: a full
batch gives every rank its B rows as the training stream does, the period's last
(shorter) batch is split as evenly as it goes, so every rank runs the same number
of batches per period.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from towerrec.data.batch import Batch, DataSchema
from towerrec.data.cache import ColumnStore, SplitColumns
from towerrec.data.dense_transform import DenseTransform
from towerrec.data.loader import SplitRows

__all__ = [
    "ColumnPeriods",
    "PeriodSource",
    "cache_periods",
    "check_bounds",
    "count_bounds",
    "period_rank_batches",
]


@runtime_checkable
class PeriodSource(Protocol):
    """Training data as periods in time order (module docstring)."""

    @property
    def schema(self) -> DataSchema: ...

    @property
    def num_periods(self) -> int: ...

    def period_rows(self, period: int) -> int:
        """Rows of ``period`` (0-based)."""
        ...

    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        """This rank's batches of ``period``, in time order."""
        ...

    def period_oracle(self, period: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Labels and true click probabilities of all of ``period``'s rows, for a source
        that knows them (a planted truth); None otherwise."""
        ...


def period_rank_batches(
    rows: int, batch_size: int, rank: int = 0, world_size: int = 1
) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of rank ``rank``'s rows in each global batch of a period of ``rows``
    rows (module docstring); the same number of batches on every rank, a share may be empty
    when the last batch has fewer rows than ranks."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size = {world_size})")
    step = batch_size * world_size
    for start in range(0, rows, step):
        m = min(step, rows - start)
        yield start + rank * m // world_size, start + (rank + 1) * m // world_size


def check_bounds(bounds: Sequence[int], what: str, fix: str) -> None:
    """``bounds [P+1]``: period p holds rows ``[bounds[p], bounds[p+1])``. A clear error for
    periods out of order or empty; ``what`` names the data, ``fix`` says what to change."""
    for p in range(len(bounds) - 1):
        if bounds[p + 1] < bounds[p]:
            raise ValueError(
                f"{what}: period {p + 1} starts (row {bounds[p + 1]}) before period {p} "
                f"(row {bounds[p]}): periods out of order; {fix}"
            )
        if bounds[p + 1] == bounds[p]:
            raise ValueError(f"{what}: period {p} is empty (no rows); {fix}")


def count_bounds(rows: int, periods: int, what: str) -> list[int]:
    """Bounds of ``periods`` slices of ``rows`` rows, of equal count (give or take one)."""
    if periods > rows:
        raise ValueError(
            f"{what} = {periods} periods but the data has only {rows} rows; use at most "
            f"{rows} periods"
        )
    return [p * rows // periods for p in range(periods + 1)]


class ColumnPeriods:
    """Periods over columns in time order: period p is rows ``[bounds[p], bounds[p+1])``
    of ``parts`` seen as one row range."""

    def __init__(
        self,
        schema: DataSchema,
        single: list[str],
        multi: list[str],
        parts: list[SplitColumns],
        bounds: Sequence[int],
        what: str = "the data",
        fix: str = "check the period settings",
    ) -> None:
        self.schema = schema
        self._single, self._multi = single, multi
        self._rows = SplitRows(parts)
        self.bounds = [int(b) for b in bounds]
        if len(self.bounds) < 2 or self.bounds[0] != 0 or self.bounds[-1] != self._rows.rows:
            raise ValueError(
                f"{what}: period bounds {self.bounds[:4]}... must run from row 0 to the last "
                f"row, {self._rows.rows}"
            )
        check_bounds(self.bounds, what, fix)
        self.dense_transform: DenseTransform | None = None

    def read_through(self, transform: DenseTransform | None) -> ColumnPeriods:
        """Every period's dense columns read through ``transform`` (the one ``towerrec
        train`` fits on the same data's training split: data/dense_transform.py); this
        object, for chaining."""
        self.dense_transform = transform
        return self

    def raw(self) -> ColumnPeriods:
        """The same periods with the dense columns as the data holds them (no transform):
        what ``towerrec data periods`` writes, recording the transform beside them."""
        out = copy.copy(self)
        out.dense_transform = None
        return out

    @property
    def num_periods(self) -> int:
        return len(self.bounds) - 1

    def period_rows(self, period: int) -> int:
        if not 0 <= period < self.num_periods:
            raise ValueError(f"period {period} is not in [0, {self.num_periods})")
        return self.bounds[period + 1] - self.bounds[period]

    def period_batches(
        self, period: int, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[Batch]:
        start = self.bounds[period]
        for lo, hi in period_rank_batches(self.period_rows(period), batch_size, rank, world_size):
            if hi > lo:
                rows = np.arange(start + lo, start + hi)
                batch = self._rows.gather(rows, self._single, self._multi)
                if self.dense_transform is not None:
                    self.dense_transform.apply(batch.dense.numpy())
                yield batch

    def period_oracle(self, period: int) -> None:
        """Recorded data has no known click probabilities."""
        return None


def _numbers(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def cache_periods(store: ColumnStore) -> ColumnPeriods:
    """Each part's training rows (one input day file of ``towerrec data criteo``) as a
    period, in the order of the cache's parts. Day files whose names carry numbers must
    come in the order of those numbers (``day_2`` before ``day_10``)."""
    parts = store.manifest.get("parts", [])
    train = store.splits.get("train", [])
    names = [str(p.get("source") or p["name"]) for p in parts if p["rows"].get("train", 0) > 0]
    fix = (
        "convert the day files again listing them in time order, without "
        "--validation-files/--test-files for the days to replay "
        "(`towerrec data criteo day_0 day_1 ... --out DIR`)"
    )
    for part in parts:
        if part["rows"].get("train", 0) == 0:
            raise ValueError(
                f"cache part {part['name']!r} has no training rows, so its period would be "
                f"empty; {fix}"
            )
    if len(train) != len(parts):
        raise ValueError(f"the cache's parts and its training split do not match; {fix}")
    stems = [name.rsplit("/", 1)[-1] for name in names]
    numbers = [_numbers(stem) for stem in stems]
    if all(numbers):
        for p in range(len(numbers) - 1):
            if numbers[p + 1] < numbers[p]:
                raise ValueError(
                    f"the cache's day files are out of order: {stems[p + 1]!r} (period "
                    f"{p + 1}) comes after {stems[p]!r}; {fix}"
                )
    bounds = np.concatenate([[0], np.cumsum([columns.rows for columns in train])])
    return ColumnPeriods(
        store.schema, store.single, store.multi, train, bounds.tolist(), "the cache", fix
    )
