"""Generic Parquet / CSV files with a declared schema, to the binary cache.

``towerrec data table`` reads Parquet (``.parquet``) or CSV (with a header)
given a ``TableSchema``: a label column, dense columns (float; missing -> 0),
categorical columns hashed into a declared table size (id 0 = missing), and
multi-hot columns (Parquet lists, or CSV strings split on ``list_delimiter``)
hashed the same way. A declared column that is absent stops with its name and
the columns present. Values are hashed with BLAKE2b of their text, so ids are
the same in every process and run.

Like every converter it writes one cache part per input file (resumable like
``towerrec data criteo``) and splits rows into validation and test as
``data/splits.py`` says: whole files, or seeded per-row fractions
(``data/convert.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.convert import Chunk, write_cache
from towerrec.data.splits import Split
from towerrec.data.text_input import Problems

__all__ = ["TableSchema", "preprocess_table"]


@dataclass(frozen=True)
class TableSchema:
    """Declared columns of a Parquet or CSV file (sizes are hash table rows, id 0 = missing)."""

    label: str
    dense: tuple[str, ...] = ()
    categorical: dict[str, int] = field(default_factory=dict)
    multi_hot: dict[str, int] = field(default_factory=dict)
    list_delimiter: str = "|"

    def __post_init__(self) -> None:
        for name, size in {**self.categorical, **self.multi_hot}.items():
            if size < 2:
                raise ValueError(f"column {name!r}: table size must be >= 2, got {size}")
        if not self.categorical and not self.multi_hot:
            raise ValueError("declare at least one categorical or multi-hot column")
        roles = [self.label, *self.dense, *self.categorical, *self.multi_hot]
        twice = sorted({c for c in roles if roles.count(c) > 1})
        if twice:
            raise ValueError(
                f"columns {twice} are declared in two roles (label, --dense, --categorical, "
                "--multi-hot); give each column one role"
            )

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.categorical, *self.multi_hot]


def _hash_ids(array: pa.Array, size: int) -> np.ndarray:
    """Stable ids in [1, size) of each value's text; 0 for nulls."""
    encoded = pc.dictionary_encode(array.cast(pa.string()))
    words = encoded.dictionary.to_pylist()
    table = np.array(
        [
            1
            + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
            % (size - 1)
            for w in words
        ]
        + [0],
        dtype=np.int32,
    )
    index = encoded.indices.fill_null(len(words)).to_numpy(zero_copy_only=False)
    return table[index]


def _table_batches(path: Path, schema: TableSchema, batch_rows: int):
    """(first row number, record batch) of the declared columns; CSV rows count from line 2."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        present = file.schema_arrow.names
        _check_columns(path, schema, present)
        start = 0
        for batch in file.iter_batches(batch_size=batch_rows, columns=schema.columns):
            yield start, batch, "row"
            start += batch.num_rows
        return
    with open(path, "rb") as f:
        header = f.readline().decode("utf-8", "replace").rstrip("\r\n")
    present = header.split(",") if header else []
    _check_columns(path, schema, present)
    types = {c: pa.string() for c in schema.columns}  # converted per batch, bad rows named
    reader = pa_csv.open_csv(
        path,
        read_options=pa_csv.ReadOptions(block_size=1 << 22),
        convert_options=pa_csv.ConvertOptions(
            include_columns=schema.columns,
            column_types=types,
            strings_can_be_null=True,
            null_values=[""],  # only an empty cell is missing ("nan" or "NA" is a bad value)
        ),
    )
    start = 2
    for batch in reader:
        yield start, batch, "line"
        start += batch.num_rows


def _check_columns(path: Path, schema: TableSchema, present: list[str]) -> None:
    for name in schema.columns:
        if name not in present:
            raise ValueError(
                f"{path} has no column {name!r} declared in the schema; its columns are {present}"
            )


def preprocess_table(
    inputs: list[str | Path],
    out_dir: str | Path,
    schema: TableSchema,
    eval_fraction: float = 0.0,
    seed: int = 0,
    strict: bool = False,
    batch_rows: int = 65_536,
    *,
    split: Split | None = None,
) -> dict[str, Any]:
    """``split`` (validation and test options) replaces ``eval_fraction`` and ``seed``."""
    multi = list(schema.multi_hot)

    def chunks(path: Path, problems: Problems) -> Iterator[Chunk]:
        for start, batch, unit in _table_batches(path, schema, batch_rows):
            n = batch.num_rows
            bad = np.zeros(n, dtype=bool)
            label = batch.column(schema.label)
            try:
                labels = pc.cast(label, pa.float64()).to_numpy(zero_copy_only=False)
            except pa.ArrowInvalid:
                labels = np.array([_float_or_nan(v) for v in label.to_pylist()])
            labels = np.where(np.isnan(labels), -1.0, labels)
            bad_label = ~np.isin(labels, (0.0, 1.0))
            dense = np.zeros((n, len(schema.dense)), dtype=np.float32)
            for j, name in enumerate(schema.dense):
                column = batch.column(name)
                try:
                    values = pc.cast(column, pa.float64()).fill_null(0).to_numpy()
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    values = np.array([_float_or_nan(v, 0.0) for v in column.to_pylist()])
                for row in np.nonzero(~np.isfinite(values) & ~bad)[0]:  # "nan", "inf", text
                    problems.add(path, _where(unit, start, row), f"{name} is not a finite number")
                bad |= ~np.isfinite(values)
                dense[:, j] = np.where(np.isfinite(values), values, 0.0)
            for row in np.nonzero(bad_label & ~bad)[0]:
                problems.add(path, _where(unit, start, row), f"label {schema.label} is not 0 or 1")
            bad |= bad_label
            ids = [_hash_ids(batch.column(c), s) for c, s in schema.categorical.items()]
            sparse = np.stack(ids, axis=1) if ids else np.zeros((n, 0), dtype=np.int32)
            bags = {}
            for name, size in schema.multi_hot.items():
                column = batch.column(name)
                if not pa.types.is_list(column.type) and not pa.types.is_large_list(column.type):
                    column = pc.split_pattern(column.cast(pa.string()), schema.list_delimiter)
                lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy()
                values = _hash_ids(pc.list_flatten(column), size)
                bags[name] = (values, lengths.astype(np.int32))
            keep = ~bad
            for name, (values, lengths) in bags.items():
                bags[name] = (values[np.repeat(keep, lengths)], lengths[keep])
            positions = np.arange(start, start + n)[keep]
            yield positions, labels[keep].astype(np.float32), dense[keep], sparse[keep], bags

    features = [SparseFeature(c, s) for c, s in schema.categorical.items()]
    features += [SparseFeature(c, s, 1.0) for c, s in schema.multi_hot.items()]
    data_schema = DataSchema(len(schema.dense), tuple(features))
    return write_cache(
        "table",
        [Path(p) for p in inputs],
        Path(out_dir),
        data_schema,
        multi,
        chunks,
        split or Split(eval_fraction, seed),
        Problems(strict=strict),
        {"label": schema.label, "dense": list(schema.dense)},
    )


def _where(unit: str, start: int, row: int | np.integer) -> int:
    return start + int(row)


def _float_or_nan(value, missing: float = float("nan")) -> float:
    if value is None or value == "":
        return missing
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")
