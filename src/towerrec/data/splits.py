"""The three splits of real data and how converters assign rows to them.

    train        what the model trains on
    validation   scored during training: early stopping, the best step, the plateau LR
    test         scored once, at the end, with the returned weights

A converter puts whole input files into validation or test (``--validation-files``,
``--test-files``) and draws the rest per row: one seeded uniform u per row (a
function of the seed, the file and the row's line, so independent of chunking)::

    u < validation_fraction                          -> validation
    validation_fraction <= u < ... + test_fraction   -> test
    otherwise                                        -> train

Caches written before the test split had one held-out split named ``eval``; it
reads as validation (``LEGACY_NAMES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "LEGACY_NAMES",
    "SPLITS",
    "Split",
    "check_fractions",
    "file_splits",
    "row_uniforms",
    "split_rows",
]

SPLITS = ("train", "validation", "test")
LEGACY_NAMES = {"eval": "validation"}


@dataclass(frozen=True)
class Split:
    """A converter's split options: validation (``eval_*``, the earlier name) and test."""

    eval_fraction: float = 0.0
    seed: int = 0
    test_fraction: float = 0.0
    eval_files: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()


def check_fractions(validation: float, test: float) -> None:
    for option, value in (("--validation-fraction", validation), ("--test-fraction", test)):
        if not 0 <= value < 1:
            raise ValueError(f"{option} must lie in [0, 1), got {value}")
    if validation + test >= 1:
        raise ValueError(
            f"--validation-fraction {validation} and --test-fraction {test} leave no training "
            "rows; their sum must be below 1"
        )


def file_splits(
    paths: Sequence[Path], validation_files: Sequence[str], test_files: Sequence[str]
) -> list[str | None]:
    """The split each input file goes to whole (None: split per row), by name or path."""
    names = {p.name for p in paths} | {str(p) for p in paths}
    for option, listed in (("--validation-files", validation_files), ("--test-files", test_files)):
        unknown = set(listed) - names
        if unknown:
            raise ValueError(
                f"{option} {sorted(unknown)} are not among the input files; list them as inputs too"
            )
    both = set(validation_files) & set(test_files)
    if both:
        raise ValueError(
            f"{sorted(both)} are given as both --validation-files and --test-files; a file "
            "goes to one split"
        )
    out: list[str | None] = []
    for p in paths:
        if p.name in validation_files or str(p) in validation_files:
            out.append("validation")
        elif p.name in test_files or str(p) in test_files:
            out.append("test")
        else:
            out.append(None)
    return out


def row_uniforms(lines: np.ndarray, seed: int, file_index: int) -> np.ndarray:
    """A uniform in [0, 1) per line (splitmix64 of seed, file and line)."""
    with np.errstate(over="ignore"):
        z = lines.astype(np.uint64) + np.uint64(
            (seed * 1_000_003 + file_index) * 0x9E3779B97F4A7C15 % 2**64
        )
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def split_rows(
    lines: np.ndarray,
    validation: float,
    test: float,
    seed: int,
    file_index: int,
    whole_file: str | None = None,
) -> dict[str, np.ndarray]:
    """Boolean masks of ``lines`` per split (see the module docstring)."""
    n = len(lines)
    if whole_file is not None:
        return {s: np.full(n, s == whole_file) for s in SPLITS}
    if validation <= 0 and test <= 0:
        return {
            "train": np.ones(n, bool),
            "validation": np.zeros(n, bool),
            "test": np.zeros(n, bool),
        }
    u = row_uniforms(lines, seed, file_index)
    to_validation = u < validation
    to_test = ~to_validation & (u < validation + test)
    return {"train": ~(to_validation | to_test), "validation": to_validation, "test": to_test}
