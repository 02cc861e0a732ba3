"""The data sources a run config names (``data.source``): ``SOURCES``, one entry each.

An entry is all that towerrec knows of a source by its name::

    build(data)               its DataSource: train, validation and test splits
    periods(data)             its time-ordered periods (PeriodSource) for towerrec replay;
    periods_hint              how to get two or more of them
    configured_periods(data)  the periods its settings ask for (towerrec train reads one stream)
    check(data)               what the [data] section must hold for it, run when the config
                              is made (config/sections.py)
    endless                   an endless stream: no epochs, no training rows to count
    raw                       raw data, whose periods can be written as period files
    describe(data)            how towerrec data profile names it; cache_dir(data): the
                              cache directory the profile is written into, if any
    export_mapping(data)      what an export records of how its raw values became ids

A new source is one more entry here. The config checks ``data.source`` against these
keys (it sits above data/ and below the build layer, ``towerrec.build``, which builds
through them); nothing else chooses by the source's name.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

from towerrec.data.augmented import AugmentedConfig, AugmentedPeriods
from towerrec.data.cache import ColumnStore, open_cache, read_manifest
from towerrec.data.dense_transform import DenseMode, DenseTransform, fit_dense_transform
from towerrec.data.loader import ColumnSource, LoaderConfig, SplitRows
from towerrec.data.movielens import (
    MovieLensConfig,
    bundled_movielens_path,
    load_movielens,
    movielens_periods,
)
from towerrec.data.periods import PeriodSource, cache_periods
from towerrec.data.source import DataSource
from towerrec.data.synthetic import SyntheticConfig, SyntheticSource

__all__ = ["SOURCES", "DataSection", "SourceEntry"]


class DataSection(Protocol):
    """What an entry reads of the run config's ``[data]`` section (``DataConfig``)."""

    @property
    def source(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def synthetic(self) -> SyntheticConfig: ...
    @property
    def movielens(self) -> MovieLensConfig: ...
    @property
    def loader(self) -> LoaderConfig: ...
    @property
    def augmented(self) -> AugmentedConfig: ...


class SourceEntry:
    """One source (module doc); the defaults are those of a source of files."""

    endless = False
    raw = True
    periods_hint = ""

    def build(self, data: DataSection, require_eval: bool = True) -> DataSource:
        """The source; ``require_eval=False``: one without a validation split is fine
        (``towerrec data profile`` reads the training split only)."""
        raise NotImplementedError

    def periods(self, data: DataSection) -> PeriodSource:
        raise NotImplementedError

    def check(self, data: DataSection) -> None:
        """A ``ValueError`` naming the fix when ``data`` lacks what this source needs."""

    def configured_periods(self, data: DataSection) -> int:
        return 0

    def describe(self, data: DataSection) -> str:
        return data.source

    def cache_dir(self, data: DataSection) -> Path | None:
        return None

    def export_mapping(self, data: DataSection) -> dict[str, Any]:
        return {}


class Synthetic(SourceEntry):
    """The built-in planted-truth stream (``data/synthetic.py``)."""

    endless = True
    periods_hint = "set data.synthetic.periods = N (N >= 2; with drift and id_turnover to move)"

    def build(self, data: DataSection, require_eval: bool = True) -> DataSource:
        return SyntheticSource(data.synthetic)

    def periods(self, data: DataSection) -> PeriodSource:
        return SyntheticSource(data.synthetic)

    def check(self, data: DataSection) -> None:
        if data.path:
            warnings.warn(
                f"data.path = {data.path!r} is ignored: data.source is 'synthetic' "
                "(set data.source to movielens, criteo or cache to read files)",
                stacklevel=3,  # DataConfig.__init__, past its __post_init__
            )

    def configured_periods(self, data: DataSection) -> int:
        return data.synthetic.periods


def _dense_transform(store: ColumnStore, loader: LoaderConfig) -> DenseTransform | None:
    """The transform ``towerrec train``'s loader fits on ``store``'s training split, for
    its periods to read through: replayed periods reach the model as the trained ones do,
    and an export of the run applies the same one."""
    return fit_dense_transform(SplitRows(store.splits.get("train", [])), loader.dense)


class MovieLens(SourceEntry):
    """A MovieLens directory (``data.path``; empty: the bundled one)."""

    periods_hint = "set data.movielens.periods = N (N >= 2)"

    def build(self, data: DataSection, require_eval: bool = True) -> DataSource:
        """Always with its validation split (a split of the ratings, never empty)."""
        path = data.path or bundled_movielens_path()
        return ColumnSource(load_movielens(path, data.movielens), data.loader, require_eval=True)

    def periods(self, data: DataSection) -> PeriodSource:
        path = data.path or bundled_movielens_path()
        dense = _dense_transform(load_movielens(path, data.movielens), data.loader)
        return movielens_periods(path, data.movielens).read_through(dense)

    def configured_periods(self, data: DataSection) -> int:
        return data.movielens.periods

    def describe(self, data: DataSection) -> str:
        return f"MovieLens {data.path or 'bundled'}"

    def export_mapping(self, data: DataSection) -> dict[str, Any]:
        movielens = data.movielens
        return {"movielens": {k: getattr(movielens, k) for k in movielens.__dataclass_fields__}}


class Cache(SourceEntry):
    """A cache written by ``towerrec data`` (``data.path``): Criteo, libFM, Parquet, CSV."""

    periods_hint = "convert two or more day files into the cache (each file is a period)"

    def build(self, data: DataSection, require_eval: bool = True) -> DataSource:
        store = open_cache(data.path, verify=data.loader.verify)
        return ColumnSource(store, data.loader, require_eval=require_eval)

    def periods(self, data: DataSection) -> PeriodSource:
        store = open_cache(data.path, verify=data.loader.verify)
        return cache_periods(store).read_through(_dense_transform(store, data.loader))

    def check(self, data: DataSection) -> None:
        if not data.path:
            raise ValueError(
                f"data.source = {data.source!r} needs data.path, the directory written by "
                "`towerrec data criteo INPUT... --out DIR` (--set data.path=DIR)"
            )

    def describe(self, data: DataSection) -> str:
        return f"cache {data.path}"

    def cache_dir(self, data: DataSection) -> Path | None:
        return Path(data.path)

    def export_mapping(self, data: DataSection) -> dict[str, Any]:
        if not data.path:
            return {}
        cache = read_manifest(data.path)
        # criteo: hashing sizes or min_count vocabulary
        return {"cache_source": cache.get("source"), "options": cache.get("options")}


class Augmented(SourceEntry):
    """Periods with teacher logits written by ``towerrec distill serve``
    (``data.augmented.dir``); ``towerrec replay`` only."""

    raw = False
    periods_hint = "write two or more periods (towerrec data periods) and augment them"

    def build(self, data: DataSection, require_eval: bool = True) -> DataSource:
        raise ValueError(
            "data.source = 'augmented' is a stream of periods with teacher logits: train on "
            "it with `towerrec replay`, which reads periods in order"
        )

    def periods(self, data: DataSection) -> PeriodSource:
        """The student's augmented periods, their dense columns read through the transform
        their period files record, or as the files hold them with ``data.loader.dense =
        "none"``."""
        augmented = data.augmented
        reader = AugmentedPeriods(augmented.dir, augmented.wait_s, augmented.poll_s)
        if DenseMode(data.loader.dense) is DenseMode.NONE:
            reader.dense_transform = None
        return reader

    def check(self, data: DataSection) -> None:
        if not data.augmented.dir:
            raise ValueError(
                "data.source = 'augmented' needs data.augmented.dir, a student's directory "
                "under the --out of `towerrec distill serve` (--set data.augmented.dir=OUT/NAME)"
            )


SOURCES: dict[str, SourceEntry] = {
    "synthetic": Synthetic(),
    "movielens": MovieLens(),
    "criteo": Cache(),
    "cache": Cache(),
    "augmented": Augmented(),
}
