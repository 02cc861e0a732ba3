"""The shared driver of the text and table converters (``data/libfm.py``,
``data/tabular.py``): one cache part per input file (resumable), rows split into
train, validation and test as ``data/splits.py`` says, and the manifest."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.cache import PartWriter, schema_to_manifest, write_manifest
from towerrec.data.splits import SPLITS, Split, check_fractions, file_splits, split_rows
from towerrec.data.text_input import Problems

__all__ = ["Chunk", "write_cache"]

Chunk = tuple[
    np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]
]
# (row positions, labels [n], dense [n, F], single-hot ids [n, S], multi name -> (values, lengths))


def write_cache(
    kind: str,
    inputs: list[Path],
    out_dir: Path,
    schema: DataSchema,
    multi: list[str],
    chunks_of: Callable[[Path, Problems], Iterator[Chunk]],
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
