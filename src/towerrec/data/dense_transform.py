"""Dense features as the model reads them: standardised by the training split's statistics.

Recorded data keeps its dense columns in their own units: prices in the thousands, counts
with a long tail, a flag of 0 or 1 side by side. An MLP reads them in one matmul, and with
raw scales the large columns swamp the others and the first layer's gradients: on the
planted data with its dense columns scaled by 1 to 1,000 and shifted by up to 5,000, the
defaults lost 0.11 test AUC (docs/benchmarks.md, model quality). ``data.loader.dense``:

    auto      each column standardised, (x - mean) / std; a non-negative column whose
              skewness exceeds ``SKEWED`` (counts, prices, durations) is first taken to
              log(1 + x) where that makes it more symmetric (the default)
    standard  each column standardised, no logarithm
    none      the values as the cache holds them

The statistics come from up to ``SAMPLE_ROWS`` training rows, in ``SAMPLE_BLOCKS`` runs
spread evenly over the split (every row of a smaller split), in float64, so every rank and
every resume of a run computes the same transform from the same cache. A column with no
spread (std 0) is shifted only. The transform runs on each batch the loader assembles
(train, validation and test alike) and on ``towerrec replay``'s periods
(``data/registry.py``), and is baked into ``towerrec export``'s program, which therefore
reads the cache's values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

__all__ = [
    "SAMPLE_BLOCKS",
    "SAMPLE_ROWS",
    "SKEWED",
    "DenseMode",
    "DenseTransform",
    "DenseTransformModule",
    "fit_dense_transform",
    "sample_rows",
]

SAMPLE_ROWS = 1_000_000
SAMPLE_BLOCKS = 1_000
SKEWED = 1.0  # skewness above which a non-negative column may be read as log(1 + x)


class DenseMode(StrEnum):
    AUTO = "auto"
    STANDARD = "standard"
    NONE = "none"


class DenseRows(Protocol):
    """What the fit reads: a split's row count and its dense rows by index."""

    rows: int

    def dense_rows(self, rows: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class DenseTransform:
    """Per column: ``log`` (read log(1 + max(x, 0)) first), then ``(x - shift) * scale``."""

    log: tuple[bool, ...]
    shift: tuple[float, ...]
    scale: tuple[float, ...]

    def __post_init__(self) -> None:
        if not len(self.log) == len(self.shift) == len(self.scale):
            raise ValueError("a dense transform needs one log flag, shift and scale a column")

    @property
    def num_dense(self) -> int:
        return len(self.shift)

    def apply(self, dense: np.ndarray) -> np.ndarray:
        """``dense [n, F]`` float32 transformed in place (and returned)."""
        if dense.shape[1] != self.num_dense:
            raise ValueError(
                f"dense rows have {dense.shape[1]} columns; the transform was fitted on "
                f"{self.num_dense}"
            )
        log = np.flatnonzero(self.log)
        if log.size:
            dense[:, log] = np.log1p(np.maximum(dense[:, log], 0))
        dense -= np.asarray(self.shift, dtype=np.float32)
        dense *= np.asarray(self.scale, dtype=np.float32)
        return dense

    def summary(self, fitted_on: int) -> str:
        """One line for the run's log: what the model reads of the dense columns."""
        logged = [j for j, flag in enumerate(self.log) if flag]
        which = f"log(1 + x) first for column(s) {logged}" if logged else "no logarithm"
        return (
            f"dense columns: {self.num_dense} standardised by {fitted_on:,} training rows, "
            f"{which} (data.loader.dense; 'none' reads them as the cache holds them)"
        )

    def module(self) -> DenseTransformModule:
        """The same map as a torch module (an exported program's first step)."""
        return DenseTransformModule(self)

    def describe(self) -> dict[str, Any]:
        return {"log": list(self.log), "shift": list(self.shift), "scale": list(self.scale)}

    @classmethod
    def from_description(cls, record: Any) -> DenseTransform:
        """The transform ``describe`` wrote (a manifest's record); ValueError naming what is
        wrong with a record it could not have written."""
        if not isinstance(record, dict) or set(record) != {"log", "shift", "scale"}:
            raise ValueError("a dense transform record holds exactly 'log', 'shift' and 'scale'")
        log, shift, scale = record["log"], record["shift"], record["scale"]
        if not all(isinstance(v, list) for v in (log, shift, scale)):
            raise ValueError("a dense transform's 'log', 'shift' and 'scale' are lists")
        if not all(isinstance(v, bool) for v in log):
            raise ValueError("a dense transform's 'log' flags are true or false")
        numbers = [*shift, *scale]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
            raise ValueError("a dense transform's 'shift' and 'scale' are numbers")
        try:
            finite = all(math.isfinite(float(v)) for v in numbers)
        except OverflowError:
            finite = False
        if not finite:
            raise ValueError("a dense transform's 'shift' and 'scale' are finite float32 numbers")
        return cls(tuple(log), tuple(float(v) for v in shift), tuple(float(v) for v in scale))


class DenseTransformModule(nn.Module):
    """``DenseTransform.apply`` on a ``[B, F]`` tensor, in float32 (torch's log1p may
    round the last bit differently from numpy's)."""

    log: torch.Tensor
    shift: torch.Tensor
    scale: torch.Tensor

    def __init__(self, transform: DenseTransform) -> None:
        super().__init__()
        self.register_buffer("log", torch.tensor(transform.log, dtype=torch.bool))
        self.register_buffer("shift", torch.tensor(transform.shift, dtype=torch.float32))
        self.register_buffer("scale", torch.tensor(transform.scale, dtype=torch.float32))

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        dense = dense.float()
        logged = torch.log1p(torch.clamp(dense, min=0))
        dense = torch.where(self.log, logged, dense)
        return (dense - self.shift) * self.scale


def sample_rows(rows: int) -> np.ndarray:
    """The training rows a fit reads: all of them up to ``SAMPLE_ROWS``, else
    ``SAMPLE_BLOCKS`` runs of consecutive rows spread evenly over the split (a memory-mapped
    cache reads a few pages a run, not one a row)."""
    if rows <= SAMPLE_ROWS:
        return np.arange(rows, dtype=np.int64)
    run = SAMPLE_ROWS // SAMPLE_BLOCKS
    starts = np.linspace(0, rows - run, SAMPLE_BLOCKS).astype(np.int64)
    return (starts[:, None] + np.arange(run, dtype=np.int64)).reshape(-1)


def _skewness(x: np.ndarray) -> np.ndarray:
    """Each column's sample skewness (0 where it does not vary)."""
    mean, std = x.mean(axis=0), x.std(axis=0)
    return np.where(std > 0, (((x - mean) / np.where(std > 0, std, 1.0)) ** 3).mean(axis=0), 0.0)


def fit_dense_transform(train: DenseRows, mode: DenseMode | str) -> DenseTransform | None:
    """The transform of ``mode`` fitted on the training rows (module doc); None for
    ``none`` or data without dense columns or rows."""
    mode = DenseMode(mode)
    if mode is DenseMode.NONE or train.rows == 0:
        return None
    sample = train.dense_rows(sample_rows(train.rows)).astype(np.float64)
    if sample.shape[1] == 0:
        return None
    sample = np.where(np.isfinite(sample), sample, 0.0)
    log = np.zeros(sample.shape[1], dtype=bool)
    if mode is DenseMode.AUTO:
        skew = _skewness(sample)
        logged = np.log1p(np.maximum(sample, 0))
        log = (sample.min(axis=0) >= 0) & (skew > SKEWED) & (np.abs(_skewness(logged)) < skew)
        sample[:, log] = logged[:, log]
    mean, std = sample.mean(axis=0), sample.std(axis=0)
    scale = 1.0 / np.where(std > 0, std, 1.0)  # a column with no spread: 1
    return DenseTransform(
        tuple(bool(v) for v in log),
        tuple(float(np.float32(v)) for v in mean),
        tuple(float(np.float32(v)) for v in scale),
    )
