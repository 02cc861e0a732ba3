"""A student's stream on disk: one cache part per period, every row with an example id.

``towerrec data periods OUT_DIR --config ...`` writes the periods of any
``PeriodSource`` (synthetic, MovieLens by timestamp, a Criteo cache of day files) into
a directory in the towerrec cache format (``data/cache.py``)::

    OUT_DIR/manifest.json                       the cache manifest, plus "stream" (below)
    OUT_DIR/parts/period-00000/train.*.bin      period 0: labels, dense, sparse, multi-hot
    OUT_DIR/parts/period-00000/train.example_id.bin   int64 [rows], one id per row
    OUT_DIR/parts/period-00001/...

The manifest's ``parts`` list only complete periods, in period order: the producer
writes a part (``PartWriter``: temp directory, fsync, rename) and then rewrites the
manifest (temp file, fsync, rename), so a reader that goes by the manifest never sees a
half-written period. ``stream`` declares the whole stream up front: ``num_periods``,
``period_rows`` (rows of every period, so a trainer knows its schedule before the last
period lands), ``first_period`` (the source period that is period 0 here) and
``dense_transform``.

Dense columns are written as the source holds them, untransformed: a teacher exported
with ``towerrec export`` reads those values (its program applies its own run's
transform). ``dense_transform`` records the transform ``towerrec train`` would fit on the
source (``data.loader.dense``: ``data/dense_transform.py``; null for none), and the
students' readers (``data/augmented.py``) apply it, so that a student reads what a run on
the source itself reads. A directory without that record was written by an earlier
towerrec, which wrote a file or MovieLens source's dense columns already transformed:
``read_stream`` refuses it (a synthetic source's, which has no transform, is read as
before).

Example ids are derived, deterministically: the row's position in the source's whole
stream (period after period, rows in order, from 0) plus ``id_offset``. Two students
written from the same source and config therefore give the same example the same id
(``--periods`` picks a window of the stream; its ids stay the stream's), and the
augmentation service scores it once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.data.batch import Batch, DataSchema
from towerrec.data.cache import (
    CacheError,
    PartWriter,
    SplitColumns,
    map_column,
    open_part,
    read_manifest,
    schema_from_manifest,
    schema_to_manifest,
    verify_part,
    write_manifest,
)
from towerrec.data.dense_transform import DenseTransform
from towerrec.data.periods import ColumnPeriods, PeriodSource

__all__ = [
    "EXAMPLE_ID",
    "SPLIT",
    "PeriodFile",
    "StreamManifest",
    "batch_columns",
    "open_period",
    "part_name",
    "read_stream",
    "stream_dense_transform",
    "write_periods",
]

EXAMPLE_ID = "example_id"
SPLIT = "train"
_BATCH = 8192


def part_name(period: int) -> str:
    return f"period-{period:05d}"


def batch_columns(
    batch: Batch, schema: DataSchema, single: list[str], multi: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """A batch as cache columns: labels [n], dense [n, F], sparse [n, T_single], and
    feature -> (values, lengths) of the multi-hot features."""
    kjt = batch.sparse
    if kjt.weights_or_none() is not None:
        raise ValueError(
            "the source's features carry per-id weights, which period files do not hold; "
            "use a source without weighted features"
        )
    n = batch.size
    sparse = np.empty((n, len(single)), dtype=np.int32)
    for t, name in enumerate(single):
        jagged = kjt[name]
        lengths = jagged.lengths.numpy()
        if n and not (lengths == 1).all():
            raise ValueError(
                f"feature {name!r} is declared single-hot (pooling factor 1) but a sample "
                f"has {int(lengths[lengths != 1][0])} ids; the source's schema is wrong"
            )
        sparse[:, t] = jagged.values.numpy()
    multi_cols = {}
    for name in multi:
        jagged = kjt[name]
        multi_cols[name] = (
            jagged.values.numpy().astype(np.int32),
            jagged.lengths.numpy().astype(np.int32),
        )
    return batch.labels.numpy(), batch.dense.numpy(), sparse, multi_cols


def _split_features(schema: DataSchema) -> tuple[list[str], list[str]]:
    single = [f.name for f in schema.sparse if f.pooling_factor == 1.0]
    multi = [f.name for f in schema.sparse if f.pooling_factor != 1.0]
    return single, multi


def write_periods(
    source: PeriodSource,
    out: str | Path,
    periods: range | None = None,
    id_offset: int = 0,
    description: str = "",
    on_period: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write ``periods`` of ``source`` (default: all) into ``out`` (module docstring), one
    part per period, the manifest rewritten after each; ``on_period(p)`` runs after period
    p is listed. Returns the final manifest."""
    out = Path(out)
    total = source.num_periods
    periods = range(total) if periods is None else periods
    if len(periods) < 1 or periods.step != 1 or periods.start < 0 or periods.stop > total:
        raise ValueError(
            f"periods {periods.start}:{periods.stop} is not a window of the source's "
            f"{total} periods; give --periods START:STOP with 0 <= START < STOP <= {total}"
        )
    if (out / "manifest.json").exists():
        raise ValueError(
            f"{out} already holds period files (manifest.json); write into a fresh directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    schema = source.schema
    transform = getattr(source, "dense_transform", None)
    if isinstance(source, ColumnPeriods):
        source = source.raw()  # the files hold the source's values (module doc)
    single, multi = _split_features(schema)
    rows = [source.period_rows(p) for p in range(total)]
    first_id = id_offset + sum(rows[: periods.start])
    manifest: dict[str, Any] = {
        "source": "periods",
        "description": description,
        "schema": schema_to_manifest(schema, set(multi)),
        "stream": {
            "num_periods": len(periods),
            "period_rows": rows[periods.start : periods.stop],
            "first_period": periods.start,
            "id_offset": id_offset,
            "dense_transform": None if transform is None else transform.describe(),
        },
        "parts": [],
    }
    write_manifest(out, manifest, fsync=True)
    next_id = first_id
    for local, p in enumerate(periods):
        writer = PartWriter(out, part_name(local), schema.num_dense, multi)
        try:
            for batch in source.period_batches(p, _BATCH):
                labels, dense, sparse, multi_cols = batch_columns(batch, schema, single, multi)
                writer.append(SPLIT, labels, dense, sparse, multi_cols)
                ids = np.arange(next_id, next_id + batch.size, dtype=np.int64)
                writer.append_column(SPLIT, EXAMPLE_ID, ids)
                next_id += batch.size
        except BaseException:
            writer.abort()
            raise
        entry = writer.finish({"period": local, "first_example_id": int(next_id - rows[p])}, True)
        manifest["parts"].append(entry)
        write_manifest(out, manifest, fsync=True)
        if on_period is not None:
            on_period(local)
    return manifest


@dataclass(frozen=True)
class StreamManifest:
    """A student's period directory as its manifest says now."""

    path: Path
    manifest: dict[str, Any]
    schema: DataSchema
    single: list[str]
    multi: list[str]

    @property
    def num_periods(self) -> int:
        return int(self.manifest["stream"]["num_periods"])

    @property
    def period_rows(self) -> list[int]:
        return [int(n) for n in self.manifest["stream"]["period_rows"]]

    def complete(self) -> list[int]:
        """The periods listed as complete, checked to be 0, 1, ..., k (a gap or a period
        out of order is an error: producers list periods in order)."""
        listed = [int(part["period"]) for part in self.manifest["parts"]]
        for i, p in enumerate(listed):
            if p != i:
                raise ValueError(
                    f"{self.path}/manifest.json lists period {p} where period {i} belongs "
                    f"(periods listed: {listed[:8]}...): a period is missing or out of order; "
                    "the producer must complete periods in order (rewrite the directory with "
                    "`towerrec data periods`)"
                )
            if p >= self.num_periods:
                raise ValueError(
                    f"{self.path}/manifest.json lists period {p} but declares "
                    f"{self.num_periods} periods; rewrite the directory"
                )
        return listed

    def entry(self, period: int) -> dict[str, Any]:
        return dict(self.manifest["parts"][period])


def read_stream(path: str | Path) -> StreamManifest:
    """The manifest of a period directory written by ``write_periods``."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest.get("source") != "periods" or "stream" not in manifest:
        raise CacheError(
            f"{path} is a towerrec cache but not a period directory (no 'stream' in its "
            "manifest); write one with `towerrec data periods DIR --config ...`"
        )
    schema, single, multi = schema_from_manifest(manifest["schema"])
    stream_dense_transform(
        manifest, path, schema.num_dense, "rewrite it with `towerrec data periods`"
    )
    return StreamManifest(path, manifest, schema, single, multi)


SYNTHETIC_STREAM = "data.source = synthetic"  # write_periods' description of such a stream


def stream_dense_transform(
    manifest: dict[str, Any], path: Path, num_dense: int, fix: str
) -> DenseTransform | None:
    """The transform a period or augmented directory's dense columns are read through
    (module doc), from ``manifest["stream"]``; CacheError naming ``fix`` for a record that
    is damaged or missing (a directory written before the record existed holds a file or
    MovieLens source's dense columns already transformed)."""
    stream = manifest.get("stream")
    if not isinstance(stream, dict) or "dense_transform" not in stream:
        if manifest.get("description") == SYNTHETIC_STREAM:
            return None  # a synthetic stream has no transform: its values are the source's
        raise CacheError(
            f"{path}/manifest.json does not record how its dense columns are read "
            "(stream.dense_transform): it was written by an earlier towerrec, whose period "
            "files hold a file or MovieLens source's dense columns already standardised, "
            f"and a teacher would standardise them again; {fix}"
        )
    record = stream["dense_transform"]
    try:
        transform = None if record is None else DenseTransform.from_description(record)
    except ValueError as e:
        raise CacheError(f"{path}/manifest.json is damaged ({e}); {fix}") from None
    if transform is not None and transform.num_dense != num_dense:
        raise CacheError(
            f"{path}/manifest.json is damaged (its dense transform has {transform.num_dense} "
            f"columns, its schema {num_dense}); {fix}"
        )
    return transform


@dataclass
class PeriodFile:
    """One complete period of a period directory, memory-mapped and checked."""

    period: int
    columns: SplitColumns
    example_ids: np.ndarray  # int64 [rows]
    checksum: str  # of the part's files, to recognise the same period later


def open_period(stream: StreamManifest, period: int, verify: bool = True) -> PeriodFile:
    """Period ``period`` (listed complete) of ``stream``; ``verify`` hashes its files."""
    entry = stream.entry(period)
    if verify:
        verify_part(stream.path, entry)
    columns = open_part(stream.path, entry, stream.schema.num_dense, stream.single, stream.multi)
    split = columns[SPLIT]
    ids = map_column(stream.path, entry["name"], SPLIT, EXAMPLE_ID, np.int64, split.rows)
    digest = json.dumps(entry["files"], sort_keys=True)
    return PeriodFile(period, split, ids, digest)
