"""``towerrec predict DIR [DATA] --out preds.parquet``: score data with an exported artefact.

``DATA`` is one of

    (nothing)             the run's own data, as its config (DIR/run_config.toml) names
                          it: the validation split (``--split`` picks another)
    a cache directory     written by ``towerrec data ...`` (its ``--split``, default validation)
    a MovieLens directory ratings.csv, movies.csv, tags.csv, read as the run read its
                          MovieLens data (ids are indexed from the files, so the same data
                          set's version maps alike); its ``--split``
    Criteo TSV files      every line, hashed into the tables as the run's cache hashed
                          (needs a run on a hashed Criteo cache, not a --min-count one);
                          a malformed line stops it, named by file and line, so that the
                          predictions stay one per line

The output holds a ``prediction`` column (click probability, float32) and, for
labelled data, ``label``, one row per sample in data order. The result reports
throughput (samples/s of scoring alone, and end to end with reading) and AUC,
log-loss and NE when labelled.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from towerrec.build.sources import build_source
from towerrec.config import DataConfig, load_config
from towerrec.data.batch import Batch, DataSchema
from towerrec.data.cache import ColumnStore, open_cache
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.dense_transform import DenseMode
from towerrec.data.loader import ColumnSource, LoaderConfig
from towerrec.data.movielens import MovieLensConfig, load_movielens
from towerrec.data.synthetic import SyntheticSource
from towerrec.serve.artefact import ArtefactError, InferenceArtefact, load_artefact
from towerrec.serve.export import RUN_CONFIG, towerrec_version
from towerrec.train.metrics import compute_metrics

__all__ = ["SPLITS", "ScoringInput", "check_schema", "open_data", "predict", "score"]

log = logging.getLogger("towerrec")

SPLITS = ("validation", "test", "train", "all")


def _only_split(store: ColumnStore, split: str) -> ColumnSource:
    """A source whose validation batches are ``split``'s rows in order (``all``: every
    split's, train first)."""
    order = ("train", "validation", "test") if split == "all" else (split,)
    parts = [p for name in order for p in store.splits.get(name, [])]
    if not sum(p.rows for p in parts):
        have = {name: store.rows(name) for name in store.splits}
        raise ValueError(f"the data's {split!r} split has no rows (rows per split: {have})")
    # ColumnSource needs training rows to exist; only its validation batches are read here
    one = dataclasses.replace(store, splits={"train": parts, "validation": parts})
    # the values as the cache holds them: the artefact's program applies the run's transform
    return ColumnSource(one, LoaderConfig(dense=DenseMode.NONE))


def _criteo_cache(files: Sequence[Path], artefact: InferenceArtefact, directory: Path) -> Path:
    """Criteo TSV files hashed as the run's cache hashed, every line into one split."""
    data = artefact.manifest["data"]
    options = data.get("options") or {}
    if data.get("cache_source") != "criteo":
        raise ValueError(
            f"raw Criteo TSV needs a model trained on a Criteo cache; this one trained on "
            f"data.source = {data['source']!r}: give a cache directory of its own format"
        )
    if options.get("min_count"):
        raise ValueError(
            "the run's Criteo cache maps values through a --min-count vocabulary, which the "
            "artefact does not carry: preprocess the files into that cache's format first "
            "(towerrec data criteo) and predict on the cache"
        )
    criteo = CriteoOptions(
        num_embeddings=tuple(options["num_embeddings"]),
        feature_prefix=options.get("feature_prefix", "cat_"),
        strict=True,  # one prediction per line: a malformed line is an error, not a skip
    )
    preprocess_criteo(files, directory, criteo, progress=False)
    return directory


@dataclasses.dataclass(frozen=True)
class ScoringInput:
    """The rows to score: their schema, batches of a given size, count (None: unknown)."""

    schema: DataSchema
    batches: Callable[[int], Iterator[Batch]]
    rows: int | None
    description: str


def _from_store(store: ColumnStore, split: str, description: str) -> ScoringInput:
    source = _only_split(store, split)
    return ScoringInput(store.schema, source.eval_batches, source.eval_rows, description)


def open_data(
    artefact: InferenceArtefact, data: Sequence[str | Path], split: str, scratch: Path
) -> ScoringInput:
    """The rows of ``data`` (module doc) to score; ``scratch``: a directory for the
    cache of raw TSV files."""
    if split not in SPLITS:
        raise ValueError(f"--split {split!r}: choose one of {list(SPLITS)}")
    paths = [Path(p) for p in data]
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(
                f"no data at {path}; give a cache or MovieLens directory, or Criteo TSV files"
            )
    if not paths:
        return _run_data(artefact, split)
    if len(paths) == 1 and paths[0].is_dir():
        directory = paths[0]
        if (directory / "manifest.json").is_file():
            return _from_store(open_cache(directory), split, f"cache {directory}, {split} split")
        if (directory / "ratings.csv").is_file():
            settings = artefact.manifest["data"].get("movielens") or {}
            store = load_movielens(directory, MovieLensConfig(**settings))
            return _from_store(store, split, f"MovieLens {directory}, {split} split")
        raise ValueError(
            f"{directory} is neither a cache (no manifest.json) nor a MovieLens directory "
            "(no ratings.csv)"
        )
    if any(p.is_dir() for p in paths):
        raise ValueError("give one cache or MovieLens directory, or Criteo TSV files, not both")
    store = open_cache(_criteo_cache(paths, artefact, scratch))
    return _from_store(store, "all", f"{len(paths)} Criteo TSV file(s)")


def _run_data(artefact: InferenceArtefact, split: str) -> ScoringInput:
    """The run's own data, as its config names it: its validation (or test) split."""
    config = load_config(base=_run_config(artefact))
    # the values as the cache holds them: the artefact's program applies the run's transform
    raw = dataclasses.replace(config.data.loader, dense=DenseMode.NONE)
    source = build_source(dataclasses.replace(config.data, loader=raw))
    described = f"the run's {_describe(config.data)}, {split} split"
    if split == "validation":
        if isinstance(source, ColumnSource):
            rows: int | None = source.eval_rows
        elif isinstance(source, SyntheticSource):
            rows = source.config.eval_samples
        else:
            rows = None
        return ScoringInput(source.schema, source.eval_batches, rows, described)
    if split == "test" and source.test_rows:
        return ScoringInput(source.schema, source.test_batches, source.test_rows, described)
    raise ValueError(
        f"--split {split!r} without DATA: the run's data gives a validation"
        + (" and a test" if source.test_rows else "")
        + " split; give DATA (a cache or MovieLens directory) to score other rows"
    )


def _describe(data: DataConfig) -> str:
    return f"data.source = {data.source!r}" + (f" ({data.path})" if data.path else "")


def _run_config(artefact: InferenceArtefact) -> Path:
    path = artefact.path / RUN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"the artefact lacks {path}, which names the run's data; give DATA, or export "
            "the run again"
        )
    return path


def check_schema(artefact: InferenceArtefact, schema: DataSchema) -> None:
    """The data must give what the artefact reads: its dense width, and every sparse
    feature with the table size the model was trained on (else ids would differ)."""
    if schema.num_dense != artefact.num_dense:
        raise ArtefactError(
            f"the data has {schema.num_dense} dense features, the model reads "
            f"{artefact.num_dense}; score data of the format the run trained on"
        )
    rows = {f.name: f.num_embeddings for f in schema.sparse}
    missing = [f.name for f in artefact.features if f.name not in rows]
    if missing:
        raise ArtefactError(
            f"the data lacks the sparse feature(s) {missing} of the model (it has "
            f"{sorted(rows)}); score data of the format the run trained on"
        )
    other = [
        f"{f.name}: {rows[f.name]} ids, the model's table {f.num_embeddings}"
        for f in artefact.features
        if rows[f.name] != f.num_embeddings
    ]
    if other:
        raise ArtefactError(
            f"the data's id spaces differ from the model's tables ({'; '.join(other[:3])}); "
            "map raw values as the run's data did (manifest.json, 'data')"
        )


def score(
    artefact: InferenceArtefact, batches: Iterator[Batch], total: int | None, progress: bool
) -> tuple[np.ndarray, np.ndarray, float]:
    """Predictions and labels of every batch; seconds spent scoring (reading excluded)."""
    preds, labels, seconds = [], [], 0.0
    with tqdm(total=total, unit="sample", unit_scale=True, disable=not progress,
              desc="predict", dynamic_ncols=True) as bar:  # fmt: skip
        for batch in batches:
            sparse = batch.sparse
            tick = time.perf_counter()
            probs = artefact.predict(
                batch.dense, sparse.keys(), sparse.values(), sparse.lengths(),
                sparse.weights_or_none(),
            )  # fmt: skip
            seconds += time.perf_counter() - tick
            preds.append(probs.numpy())
            labels.append(batch.labels.numpy())
            bar.update(batch.size)
    empty = np.zeros(0, dtype=np.float32)
    return (
        np.concatenate(preds) if preds else empty,
        np.concatenate(labels) if labels else empty,
        seconds,
    )


def predict(
    artefact_dir: str | Path,
    data: Sequence[str | Path] = (),
    out: str | Path | None = None,
    *,
    split: str = "validation",
    batch_size: int = 8192,
    progress: bool = True,
    artefact: InferenceArtefact | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Score ``data`` (module doc) with the artefact in ``artefact_dir``; writes ``out``
    (parquet) when given; returns the counts, throughput and metrics. ``verify``: check
    the artefact's files against its checksums when loading it."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if artefact is None:
        artefact = load_artefact(artefact_dir, towerrec_version=towerrec_version(), verify=verify)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="towerrec-predict-") as scratch:
        rows = open_data(artefact, data, split, Path(scratch))
        check_schema(artefact, rows.schema)
        described = rows.description
        batches = rows.batches(batch_size)
        preds, labels, seconds = score(artefact, batches, rows.rows, progress)
    wall = time.perf_counter() - start
    if not len(preds):
        raise ValueError(f"{described} has no rows to score")
    result: dict[str, Any] = {
        "data": described,
        "samples": len(preds),
        "samples_per_s": len(preds) / seconds if seconds else None,
        "end_to_end_samples_per_s": len(preds) / wall,
        "tables": artefact.table_dtype,
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
    }
    if bool(np.isin(labels, (0.0, 1.0)).all()):  # AUC and log-loss need 0/1 labels
        result.update(compute_metrics(torch.from_numpy(preds), torch.from_numpy(labels)).as_dict())
    else:
        log.warning("the labels are not all 0 or 1: no AUC or log-loss reported")
    if out is not None:
        table = pa.table({"prediction": preds.astype(np.float32), "label": labels})
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out)
        result["out"] = str(out)
    log.info("scored %s samples of %s", f"{len(preds):,}", described)
    return result
