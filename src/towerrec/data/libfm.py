"""libFM text to the binary cache.

``towerrec data libfm`` reads ``label idx:val idx:val ...`` lines (Frappe and
Avazu exports) with a *field map*, a text file of lines ``name first last
[single|multi|dense]``: indices first..last (inclusive) belong to field
``name``. A single-hot field's id is ``1 + idx - first`` (0: absent); a
multi-hot field keeps every index present; a dense field gives one dense column
per index, holding ``val``. Labels > 0 are clicks (so -1/1 and 0/1 both work).

Like every converter it writes one cache part per input file (resumable like
``towerrec data criteo``) and splits rows into validation and test as
``data/splits.py`` says: whole files, or seeded per-row fractions
(``data/convert.py``).
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.convert import Chunk, write_cache
from towerrec.data.splits import Split
from towerrec.data.text_input import Problems, read_chunks

__all__ = ["FieldMap", "infer_field_map", "preprocess_libfm", "read_field_map", "write_field_map"]


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
            for offset, text in enumerate(_lines(chunk.data)):
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


def _lines(data: bytes) -> list[str]:
    """The lines of a chunk, split at LF only (as its lines were counted: ``str.splitlines``
    also splits at form feeds and other separators, which would shift the line numbers);
    a CR before the LF goes with it."""
    lines = data.decode("utf-8", "replace").split("\n")
    if lines and not lines[-1]:
        lines.pop()  # the chunk's last newline
    return [line.removesuffix("\r") for line in lines]


def _parse_libfm_line(text, fields, single_col, multi, dense_cols):
    """(label, dense, single ids, multi ids) or the reason the line is malformed."""
    tokens = text.split()
    if not tokens:
        return "empty line"
    try:
        number = float(tokens[0])
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        return f"label {tokens[0]!r} is not a number"
    label = 1.0 if number > 0 else 0.0
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
        if not math.isfinite(value):
            return f"token {token!r}: the value is not a finite number"
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
    return write_cache(
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
