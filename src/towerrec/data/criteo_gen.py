"""Criteo-format TSV files with realistic value distributions (``towerrec data gen-criteo``).

The real Criteo logs may not be redistributed; these files have their format
and roughly their statistics, so preprocessing, training and the benchmarks
run anywhere::

    label   Bernoulli(sigmoid(z)), click rate about 0.25; z mixes a few integer
            features and per-value effects of a few categoricals (learnable signal)
    I1..I13 heavy-tailed counts (rounded log-normal), a few columns with -1/-2,
            per-column missing rates between 0 and 75 % like the Kaggle set
    C1..C26 8-hex-digit hashes of Zipf-distributed values, per-column
            cardinalities from tens to millions (scaled by ``cardinality_scale``),
            missing rates up to 45 % in the later columns

Rows are generated in blocks seeded by (seed, file, block): the same arguments
give the same bytes.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from towerrec.utils import stable_seed

__all__ = ["CARDINALITIES", "generate_criteo_file", "generate_criteo_files"]

# Per-column cardinalities of the Criteo Kaggle set (rounded).
# fmt: off
CARDINALITIES = (
    1460, 583, 10_131_227, 2_202_608, 305, 24, 12_517, 633, 3, 93_145, 5_683, 8_351_593, 3_194,
    27, 14_992, 5_461_306, 10, 5_652, 2_173, 4, 7_046_547, 18, 15, 286_181, 105, 142_572,
)
# fmt: on
_INT_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.76, 0.22)
_INT_SCALE = (1.0, 3.5, 2.5, 1.8, 8.0, 3.5, 2.0, 2.5, 4.0, 0.5, 1.0, 1.0, 2.0)
_CAT_MISSING = (0,) * 18 + (0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44)
_BLOCK = 65_536


def _hex8(values: np.ndarray) -> np.ndarray:
    """uint32 values as 8 lowercase hex digits, an ``S8`` array."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    shifts = np.arange(28, -4, -4, dtype=np.uint32)
    nibbles = (values[:, None] >> shifts[None, :]) & np.uint32(15)
    return digits[nibbles].reshape(-1).view("S8")


def _block(rows: int, seed: int, cardinality_scale: float) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns: dict[str, pa.Array] = {}
    logit = np.full(rows, -1.4)
    ints = []
    for j in range(13):
        x = np.floor(np.expm1(rng.normal(0, 1, rows) * 0.9 + np.log1p(_INT_SCALE[j]))).astype(
            np.int64
        )
        if j == 1:  # I2 has negative values in the real data
            x -= (rng.random(rows) < 0.1).astype(np.int64) * 3
        ints.append(x)
        if j in (0, 5, 10):
            logit += 0.35 * (np.log1p(np.maximum(x, 0)) - np.log1p(_INT_SCALE[j]))
    cats = []
    for j, card in enumerate(CARDINALITIES):
        card = max(2, int(card * cardinality_scale)) if card > 100 else card
        ranks = np.minimum(rng.zipf(1.15, rows) - 1, card - 1)
        if j in (1, 4, 13, 16):  # the label depends on the value of a few columns
            effect = np.sin(ranks * 2.654 + j) * 0.8
            logit += effect
        hashed = (
            ranks.astype(np.uint64) * np.uint64(2654435761) + np.uint64(j * 97_531)
        ) % np.uint64(2**32)
        cats.append(hashed.astype(np.uint32))
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    columns["label"] = pa.array(labels)
    for j, x in enumerate(ints):
        columns[f"I{j + 1}"] = pa.array(x, mask=rng.random(rows) < _INT_MISSING[j])
    for j, h in enumerate(cats):
        text = pa.array(_hex8(h), type=pa.binary()).cast(pa.string())
        columns[f"C{j + 1}"] = _with_nulls(text, rng.random(rows) < _CAT_MISSING[j])
    return pa.table(columns)


def _with_nulls(array: pa.Array, mask: np.ndarray) -> pa.Array:
    if not mask.any():
        return array
    return pc.if_else(pa.array(mask), pa.scalar(None, pa.string()), array)


def generate_criteo_file(
    path: str | Path,
    rows: int,
    seed: int = 0,
    file_index: int = 0,
    gzip_output: bool = False,
    cardinality_scale: float = 0.01,
) -> Path:
    """Write ``rows`` Criteo-format lines to ``path`` (gzip when ``gzip_output``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = open(path, "wb")  # noqa: SIM115
    out = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) if gzip_output else raw
    options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    try:
        for block, start in enumerate(range(0, rows, _BLOCK)):
            table = _block(
                min(_BLOCK, rows - start),
                stable_seed("criteo", seed, file_index, block),
                cardinality_scale,
            )
            buffer = io.BytesIO()
            pa_csv.write_csv(table, buffer, write_options=options)
            out.write(buffer.getvalue())
    finally:
        out.close()
        if out is not raw:
            raw.close()
    return path


def generate_criteo_files(
    out_dir: str | Path,
    files: int,
    rows_per_file: int,
    seed: int = 0,
    gzip_output: bool = False,
    cardinality_scale: float = 0.01,
) -> list[Path]:
    """``day_0 .. day_<files-1>`` (``.gz`` when compressed) in ``out_dir``."""
    suffix = ".gz" if gzip_output else ""
    return [
        generate_criteo_file(
            Path(out_dir) / f"day_{i}{suffix}",
            rows_per_file,
            seed,
            i,
            gzip_output,
            cardinality_scale,
        )
        for i in range(files)
    ]
