"""The data sets of ``towerrec bench quality``, and their rows as plain tensors.

Each data set is a towerrec data config (``DataSet.overrides``) with train, validation
and test splits; both sides of the benchmark read the same rows of it:

    synthetic   the planted-truth stream written to a cache: the first N training
                samples, the fixed validation set's first M samples, and as the test
                split the M training samples after the first N (``write_synthetic_cache``)
    synthetic-large
                the same stream with tables of 50,000 to 500,000 rows (``LARGE_TABLES``):
                a large vocabulary, most rows seen a few times in N samples
    synthetic-raw
                the same stream with its dense columns in units of their own, as recorded
                data has them (``raw_units``): column j is ``s_j exp(x_j)``, amounts with a
                long tail on scales s_j from 1 to 1,000
    movielens   the bundled ml-latest-small (or a given directory), its time split with
                a test split of the latest ratings added when the config has none
    criteo      Criteo-format files generated here (``gen-criteo``, seeded), converted with
                seeded 10 % validation and 10 % test splits
    NAME=PATH   a cache from ``towerrec data ...`` (e.g. a libFM data set) or a MovieLens
                directory; a cache without a test split is scored on its validation split

``plain_data`` materialises a config's splits through towerrec's loader, once, as the
tensors the plain references take (``quality_models.PlainData``): the dense columns as
the cache holds them, standardised with the training split's mean and standard deviation,
as a plain PyTorch user prepares them (towerrec's side reads them through its own
``data.loader.dense``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from towerrec.bench.quality_models import Bag, PlainData
from towerrec.build.sources import build_source
from towerrec.config import Config, load_config
from towerrec.data.batch import Batch
from towerrec.data.cache import PartWriter, schema_to_manifest, write_manifest
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.data.dense_transform import DenseMode
from towerrec.data.loader import ColumnSource
from towerrec.data.synthetic import SyntheticSource

__all__ = [
    "BUILT_IN",
    "LARGE_TABLES",
    "RAW_UNITS",
    "SYNTHETIC",
    "DataSet",
    "plain_data",
    "raw_units",
    "unseen_id_rows",
    "write_synthetic_cache",
]

BUILT_IN = ("synthetic", "synthetic-large", "synthetic-raw", "movielens", "criteo")
# The large-vocabulary planted data's table sizes, one per table of the default stream.
LARGE_TABLES = (200_000, 100_000, 500_000, 50_000, 300_000, 200_000, 100_000, 200_000, 500_000)
# The planted data sets and their data overrides.
SYNTHETIC: dict[str, tuple[str, ...]] = {
    "synthetic": (),
    "synthetic-large": (f"data.synthetic.num_embeddings={list(LARGE_TABLES)}",),
    "synthetic-raw": (),
}
# The planted data sets written with their dense columns in units of their own.
RAW_UNITS = ("synthetic-raw",)
RAW_SCALE_RANGE = (1.0, 1000.0)  # the columns' scales, spaced evenly on a log scale


def raw_units(dense: np.ndarray) -> np.ndarray:
    """The planted dense columns ``x [n, F]`` as amounts of their own units: column j is
    ``s_j exp(x_j)``, s_j from 1 to 1,000 (module doc)."""
    low, high = np.log10(RAW_SCALE_RANGE)
    scales = np.logspace(low, high, dense.shape[1]).astype(np.float32)
    return (np.exp(dense) * scales).astype(np.float32)


@dataclass(frozen=True)
class DataSet:
    """A data set of the benchmark: its name, the towerrec config that trains on it
    (None: the built-in defaults) and the data overrides that point it at the rows."""

    name: str
    config: Path | None
    overrides: tuple[str, ...]

    def load(self, extra: list[str] | tuple[str, ...] = ()) -> Config:
        return load_config(self.config, [*self.overrides, *extra])


# ------------------------------------------------------------------ plain tensors
def _plain(batch: Batch, sizes: list[int], scaler: tuple[torch.Tensor, torch.Tensor]) -> PlainData:
    bags = []
    for (name, jagged), size in zip(batch.sparse.to_dict().items(), sizes):
        bags.append(Bag(jagged.values.long(), jagged.offsets(), size, name))
    mean, std = scaler
    return PlainData((batch.dense.float() - mean) / std, batch.labels.float(), tuple(bags))


def _one_batch(batches) -> Batch:
    (batch,) = list(batches)
    return batch


def plain_data(config: Config) -> tuple[PlainData, PlainData, PlainData | None]:
    """The train, validation and test rows (None: no test split) of ``config.data``."""
    as_held = dataclasses.replace(config.data.loader, dense=DenseMode.NONE)
    source = build_source(dataclasses.replace(config.data, loader=as_held))
    if not isinstance(source, ColumnSource):
        raise ValueError(
            f"the plain-PyTorch references read a data set's rows, but data.source = "
            f"{config.data.source!r} is a stream; use a cache or MovieLens"
        )
    sizes = [f.num_embeddings for f in source.schema.sparse]
    train_rows = source.train_batch(0, source.train_rows)  # epoch 0: every row once
    valid = _one_batch(source.eval_batches(source.eval_rows))
    test = _one_batch(source.test_batches(source.test_rows)) if source.test_rows else None
    scaler = _standard_scaler(train_rows.dense)
    return (
        _plain(train_rows, sizes, scaler),
        _plain(valid, sizes, scaler),
        None if test is None else _plain(test, sizes, scaler),
    )


def unseen_id_rows(train: PlainData, held_out: PlainData) -> dict[str, float]:
    """Per feature (by name), the share of ``held_out``'s rows with an id that no training row has:
    rows the models can only meet with an untrained embedding row (its initial value). On
    a split by time these are the users and items that arrived after the training period."""
    shares = {}
    for seen_bag, bag in zip(train.bags, held_out.bags, strict=True):
        seen = torch.zeros(bag.num_embeddings, dtype=torch.bool)
        seen[seen_bag.values] = True
        running = torch.cat(
            [torch.zeros(1, dtype=torch.long), (~seen[bag.values]).long().cumsum(0)]
        )
        per_row = running[bag.offsets[1:]] - running[bag.offsets[:-1]]  # unseen ids a row
        shares[bag.name] = round(float((per_row > 0).double().mean()), 4)
    return shares


def _standard_scaler(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training rows' mean and standard deviation per dense column (1 where a column
    has no spread): what ``(x - mean) / std`` divides by."""
    values = dense.double()
    std = values.std(dim=0, unbiased=False)
    return values.mean(dim=0).float(), torch.where(std > 0, std, 1.0).float()


# ------------------------------------------------------------------ built-in data sets
def write_synthetic_cache(
    config: Config, out: Path, train_rows: int, held_out_rows: int, raw: bool = False
) -> Path:
    """Write the synthetic stream of ``config.data.synthetic`` as a cache (module doc);
    ``raw``: its dense columns in units of their own (``raw_units``)."""
    if (out / "manifest.json").is_file():
        return out
    source = SyntheticSource(config.data.synthetic)
    schema = source.schema
    multi = [f.name for f in schema.sparse if f.pooling_factor > 1]
    writer = PartWriter(out, "00000-synthetic", schema.num_dense, multi)
    splits = {
        "train": source.samples("train", 0, train_rows)[0],
        "validation": source.samples("eval", 0, held_out_rows)[0],
        "test": source.samples("train", train_rows, held_out_rows)[0],
    }
    for split, batch in splits.items():
        jagged = batch.sparse.to_dict()
        single = [
            jagged[f.name].values.numpy().reshape(batch.size) for f in schema.sparse
            if f.name not in multi
        ]  # fmt: skip
        bags = {name: (jagged[name].values.numpy(), jagged[name].lengths.numpy()) for name in multi}
        writer.append(
            split,
            batch.labels.numpy(),
            raw_units(batch.dense.numpy()) if raw else batch.dense.numpy(),
            np.stack(single, axis=1) if single else np.zeros((batch.size, 0), np.int32),
            bags,
        )
    entry = writer.finish({"source": "synthetic"})
    manifest = {
        "source": "synthetic",
        "schema": schema_to_manifest(schema, set(multi)),
        "rows": entry["rows"],
        "options": {"train_rows": train_rows, "held_out_rows": held_out_rows, "raw_units": raw},
        "report": {},
        "parts": [entry],
    }
    write_manifest(out, manifest)
    return out


def criteo_cache(out: Path, files: int, rows: int, num_embeddings: int) -> Path:
    """Generated Criteo-format files, converted with 10 % validation and 10 % test."""
    if (out / "cache" / "manifest.json").is_file():
        return out / "cache"
    paths = generate_criteo_files(out / "raw", files, rows, seed=0)
    options = CriteoOptions(
        num_embeddings=(num_embeddings,), eval_fraction=0.1, test_fraction=0.1, seed=0
    )
    with contextlib.redirect_stdout(sys.stderr):
        preprocess_criteo(paths, out / "cache", options, progress=False)
    return out / "cache"


def cache_overrides(path: Path) -> tuple[str, ...]:
    """The data overrides of a cache directory or a MovieLens directory."""
    if (path / "ratings.csv").is_file():
        return ("data.source=movielens", f"data.path={json.dumps(str(path))}")
    if (path / "manifest.json").is_file():
        return ("data.source=cache", f"data.path={json.dumps(str(path))}")
    raise FileNotFoundError(
        f"bench quality --data: {path} is neither a cache directory (with manifest.json, from "
        "`towerrec data ...`) nor a MovieLens directory (with ratings.csv)"
    )


def movielens_overrides(config_path: Path | None, path: str) -> tuple[str, ...]:
    """MovieLens from ``path`` ("": the bundled one), with a test split of the latest 10 %
    of ratings when the config has none."""
    overrides = ("data.source=movielens", f"data.path={json.dumps(path)}")
    if load_config(config_path, list(overrides)).data.movielens.test_fraction == 0:
        overrides += ("data.movielens.test_fraction=0.1",)
    return overrides
