"""libFM text and generic Parquet / CSV files with a declared schema, to the binary cache.

``towerrec data libfm`` reads ``label idx:val idx:val ...`` lines (Frappe and
Avazu exports) with a *field map*, a text file of lines ``name first last
[single|multi|dense]``: indices first..last (inclusive) belong to field
``name``. A single-hot field's id is ``1 + idx - first`` (0: absent); a
multi-hot field keeps every index present; a dense field gives one dense column
per index, holding ``val``. Labels > 0 are clicks (so -1/1 and 0/1 both work).

``towerrec data table`` reads Parquet (``.parquet``) or CSV (with a header)
given a ``TableSchema``: a label column, dense columns (float; missing -> 0),
categorical columns hashed into a declared table size (id 0 = missing), and
multi-hot columns (Parquet lists, or CSV strings split on ``list_delimiter``)
hashed the same way. A declared column that is absent stops with its name and
the columns present. Values are hashed with BLAKE2b of their text, so ids are
the same in every process and run.

Both write one cache part per input file (resumable like ``towerrec data
criteo``) and split rows into validation and test as ``data/splits.py`` says:
whole files, or seeded per-row fractions.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.cache import PartWriter, schema_to_manifest, write_manifest
from towerrec.data.splits import SPLITS, Split, check_fractions, file_splits, split_rows
from towerrec.data.text_input import Problems, read_chunks

__all__ = [
    "FieldMap",
    "Split",
    "TableSchema",
    "preprocess_libfm",
    "preprocess_table",
    "read_field_map",
]

Chunk = tuple[
    np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]
]
# (row positions, labels [n], dense [n, F], single-hot ids [n, S], multi name -> (values, lengths))


# ------------------------------------------------------------------ shared driver
def _write_cache(
    kind: str,
    inputs: list[Path],
    out_dir: Path,
    schema: DataSchema,
    multi: list[str],
    chunks_of,  # (path, problems) -> Iterator[Chunk]
    split: Split,
    problems: Problems,
    extra: dict[str, Any],
) -> dict[str, Any]:
    check_fractions(split.eval_fraction, split.test_fraction)
    for path in inputs:
        if not path.is_file():
            raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    whole = file_splits(inputs, split.eval_files, split.test_files)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts, rows = [], dict.fromkeys(SPLITS, 0)
    for index, path in enumerate(inputs):
        writer = PartWriter(out_dir, f"{index:05d}-{path.name}", schema.num_dense, multi)
        seen = 0
        try:
            for positions, labels, dense, sparse, bags in chunks_of(path, problems):
                seen += len(labels)
                masks = split_rows(
                    positions, split.eval_fraction, split.test_fraction, split.seed, index,
                    whole[index],
                )  # fmt: skip
                for name, mask in masks.items():
                    if not mask.any():
                        continue
                    picked = {}
                    for bag, (values, lengths) in bags.items():
                        picked[bag] = (values[np.repeat(mask, lengths)], lengths[mask])
                    writer.append(name, labels[mask], dense[mask], sparse[mask], picked)
            if seen == 0:
                problems.add(path, None, "empty file (no rows)")
        except BaseException:
            writer.abort()
            raise
        entry = writer.finish({"source": str(path.resolve())})
        for name, n in entry["rows"].items():
            rows[name] += n
        parts.append(entry)
    if sum(rows.values()) == 0:
        raise ValueError(f"no valid rows in {len(inputs)} input file(s): {problems.one_line()}")
    ids = {name: 0 for name in multi}  # mean ids per sample of the multi-hot features
    for entry in parts:
        for totals in entry["multi_values"].values():
            for name, count in totals.items():
                ids[name] += count
    schema = DataSchema(
        schema.num_dense,
        tuple(
            SparseFeature(f.name, f.num_embeddings, max(ids[f.name] / sum(rows.values()), 1.0))
            if f.name in ids
            else f
            for f in schema.sparse
        ),
    )
    manifest = {
        "source": kind,
        "schema": schema_to_manifest(schema, set(multi)),
        "rows": rows,
        "options": {**asdict(split), **extra},
        "report": problems.as_dict(),
        "parts": parts,
    }
    write_manifest(out_dir, manifest)
    return manifest


# ------------------------------------------------------------------ libFM
@dataclass(frozen=True)
class FieldMap:
    names: tuple[str, ...]
    firsts: tuple[int, ...]
    lasts: tuple[int, ...]
    kinds: tuple[str, ...]  # single | multi | dense

    def field_of(self, index: int) -> int:
        at = int(np.searchsorted(self.firsts, index, side="right")) - 1
        return at if at >= 0 and index <= self.lasts[at] else -1


def read_field_map(path: str | Path) -> FieldMap:
    """Parse ``name first last [kind]`` lines; ranges must not overlap."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"field map {str(path)!r} does not exist")
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            name, first, last = words[0], int(words[1]), int(words[2])
            kind = words[3] if len(words) > 3 else "single"
        except (IndexError, ValueError):
            raise ValueError(
                f"{path}:{number}: expected 'name first last [single|multi|dense]', got {line!r}"
            ) from None
        if kind not in ("single", "multi", "dense") or first > last or first < 0:
            raise ValueError(
                f"{path}:{number}: bad field {line!r}; need 0 <= first <= last and a kind of "
                "single, multi or dense"
            )
        entries.append((first, last, name, kind))
    if not entries:
        raise ValueError(f"field map {path} declares no fields")
    entries.sort()
    for (_, last, name, _), (first, _, other, _) in pairwise(entries):
        if first <= last:
            raise ValueError(
                f"field map {path}: fields {name!r} and {other!r} overlap at indices "
                f"{first}..{last}; give each index to one field"
            )
        if first > last + 1:
            raise ValueError(
                f"field map {path}: indices {last + 1}..{first - 1} between fields {name!r} "
                f"and {other!r} belong to no field; extend one of them or add a field for them"
            )
    firsts, lasts, names, kinds = zip(*entries)
    return FieldMap(names, firsts, lasts, kinds)


def _open_maybe_gzip(path: Path) -> Any:
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def infer_field_map(inputs: list[str | Path], max_lines: int = 200_000) -> FieldMap:
    """A field map read off libFM lines written one token per field in a fixed order (as
    Frappe, Avazu and Criteo exports are): field j spans the indices seen at position j,
    widened to meet field j+1; a position that always holds one index with varying
    values is dense. Reads at most ``max_lines`` lines; its result is for review."""
    lows: list[int] = []
    highs: list[int] = []
    values: list[set[float]] = []
    seen = 0
    for path in inputs:
        with _open_maybe_gzip(Path(path)) as f:
            for number, raw in enumerate(f, 1):
                if seen >= max_lines:
                    break
                tokens = raw.decode("utf-8", "replace").split()[1:]
                if not tokens:
                    continue
                if lows and len(tokens) != len(lows):
                    raise ValueError(
                        f"{path}:{number}: {len(tokens)} idx:val tokens where earlier lines have "
                        f"{len(lows)}; a field map can be inferred only from lines with one token "
                        "per field; write it by hand ('name first last [single|multi|dense]')"
                    )
                try:
                    pairs = [(int(i), float(v)) for i, _, v in (t.partition(":") for t in tokens)]
                except ValueError:
                    raise ValueError(f"{path}:{number}: a token is not idx:val") from None
                if not lows:
                    lows, highs = [i for i, _ in pairs], [i for i, _ in pairs]
                    values = [set() for _ in pairs]
                for j, (index, value) in enumerate(pairs):
                    lows[j], highs[j] = min(lows[j], index), max(highs[j], index)
                    if len(values[j]) < 3:
                        values[j].add(value)
                seen += 1
    if not lows:
        raise ValueError(f"no libFM lines to infer a field map from in {list(map(str, inputs))}")
    order = sorted(range(len(lows)), key=lambda j: lows[j])
    for a, b in pairwise(order):
        if lows[b] <= highs[a]:
            raise ValueError(
                f"token positions {a} and {b} share indices {lows[b]}..{highs[a]}: these lines do "
                "not keep one field per position; write the field map by hand"
            )
    firsts = [0 if k == 0 else lows[j] for k, j in enumerate(order)]
    lasts = [firsts[k + 1] - 1 for k in range(len(order) - 1)] + [highs[order[-1]]]
    kinds = ["dense" if lows[j] == highs[j] and len(values[j]) > 1 else "single" for j in order]
    names = [f"f{j}" for j in order]
    return FieldMap(tuple(names), tuple(firsts), tuple(lasts), tuple(kinds))


def write_field_map(fields: FieldMap, path: str | Path) -> None:
    lines = ["# name first last kind (indices first..last inclusive belong to the field)"]
    lines += [
        f"{n} {a} {b} {k}"
        for n, a, b, k in zip(fields.names, fields.firsts, fields.lasts, fields.kinds)
    ]
    Path(path).write_text("\n".join(lines) + "\n")


def _libfm_chunks(fields: FieldMap, chunk_bytes: int):
    single = [i for i, k in enumerate(fields.kinds) if k == "single"]
    multi = [i for i, k in enumerate(fields.kinds) if k == "multi"]
    dense_cols: dict[int, int] = {}
    for i, k in enumerate(fields.kinds):
        if k == "dense":
            for idx in range(fields.firsts[i], fields.lasts[i] + 1):
                dense_cols[idx] = len(dense_cols)
    single_col = {f: j for j, f in enumerate(single)}

    def chunks(path: Path, problems: Problems) -> Iterator[Chunk]:
        for chunk in read_chunks(path, problems, chunk_bytes):
            lines, labels, dense, sparse = [], [], [], []
            bags: dict[int, tuple[list[int], list[int]]] = {f: ([], []) for f in multi}
            for offset, text in enumerate(chunk.data.decode("utf-8", "replace").splitlines()):
                line = chunk.first_line + offset
                row = _parse_libfm_line(text, fields, single_col, multi, dense_cols)
                if isinstance(row, str):
                    problems.add(path, line, row)
                    continue
                label, d, s, m = row
                lines.append(line)
                labels.append(label)
                dense.append(d)
                sparse.append(s)
                for f in multi:
                    bags[f][0].extend(m[f])
                    bags[f][1].append(len(m[f]))
            n = len(labels)
            yield (
                np.asarray(lines, dtype=np.int64),
                np.asarray(labels, dtype=np.float32),
                np.asarray(dense, dtype=np.float32).reshape(n, len(dense_cols)),
                np.asarray(sparse, dtype=np.int32).reshape(n, len(single)),
                {
                    fields.names[f]: (np.asarray(v, np.int32), np.asarray(c, np.int32))
                    for f, (v, c) in bags.items()
                },
            )

    return chunks, single, multi, len(dense_cols)


def _parse_libfm_line(text, fields, single_col, multi, dense_cols):
    """(label, dense, single ids, multi ids) or the reason the line is malformed."""
    tokens = text.split()
    if not tokens:
        return "empty line"
    try:
        label = 1.0 if float(tokens[0]) > 0 else 0.0
    except ValueError:
        return f"label {tokens[0]!r} is not a number"
    dense = [0.0] * len(dense_cols)
    single = [0] * len(single_col)
    bags: dict[int, list[int]] = {f: [] for f in multi}
    for token in tokens[1:]:
        index_text, sep, value_text = token.partition(":")
        try:
            index, value = int(index_text), float(value_text)
        except ValueError:
            return f"token {token!r} is not idx:val"
        if not sep:
            return f"token {token!r} is not idx:val"
        f = fields.field_of(index)
        if f < 0:
            return f"index {index} is in no field of the field map"
        kind = fields.kinds[f]
        if kind == "dense":
            dense[dense_cols[index]] = value
        elif kind == "multi":
            bags[f].append(index - fields.firsts[f])
        else:
            col = single_col[f]
            if single[col]:
                return f"single-hot field {fields.names[f]!r} has two indices"
            single[col] = 1 + index - fields.firsts[f]
    return label, dense, single, bags


def preprocess_libfm(
    inputs: list[str | Path],
    out_dir: str | Path,
    field_map: str | Path,
    eval_fraction: float = 0.0,
    seed: int = 0,
    strict: bool = False,
    chunk_bytes: int = 8 << 20,
    *,
    split: Split | None = None,
) -> dict[str, Any]:
    """``split`` (validation and test options) replaces ``eval_fraction`` and ``seed``."""
    fields = read_field_map(field_map)
    chunks, single, multi, num_dense = _libfm_chunks(fields, chunk_bytes)
    features = [
        SparseFeature(fields.names[f], fields.lasts[f] - fields.firsts[f] + 2) for f in single
    ] + [SparseFeature(fields.names[f], fields.lasts[f] - fields.firsts[f] + 1) for f in multi]
    schema = DataSchema(num_dense, tuple(features))
    return _write_cache(
        "libfm",
        [Path(p) for p in inputs],
        Path(out_dir),
        schema,
        [fields.names[f] for f in multi],
        chunks,
        split or Split(eval_fraction, seed),
        Problems(strict=strict),
        {"field_map": str(Path(field_map).resolve())},
    )


# ------------------------------------------------------------------ Parquet / CSV
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
            include_columns=schema.columns, column_types=types, strings_can_be_null=True
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
                    for row in np.nonzero(np.isnan(values) & ~bad)[0]:
                        problems.add(path, _where(unit, start, row), f"{name} is not a number")
                    bad |= np.isnan(values)
                dense[:, j] = values
            for row in np.nonzero(bad_label & ~bad)[0]:
                problems.add(path, _where(unit, start, row), f"label {schema.label} is not 0 or 1")
            bad |= bad_label
            sparse = np.stack(
                [_hash_ids(batch.column(c), s) for c, s in schema.categorical.items()], axis=1
            ).reshape(n, len(schema.categorical))
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
    return _write_cache(
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
