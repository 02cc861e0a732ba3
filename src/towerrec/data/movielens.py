"""MovieLens (the ml-latest-small layout) as a click-through task.

The data set (GroupLens, bundled in ``datasets/ml-latest-small`` with its
README, which states the licence) is a directory of ``ratings.csv``,
``movies.csv`` and ``tags.csv``. Each rating is one sample::

    label     rating >= min_rating (4 by default): a "click"
    user      single-hot  1 + index of userId among the sorted user ids
    movie     single-hot  1 + index of movieId among the sorted movie ids
    year      single-hot  release year from the title, "(1995)"; 0 = unknown
    genres    multi-hot   the movie's genres (Adventure|Comedy|...), pooled
    tags      multi-hot   the movie's distinct tags (lowercased) used by at
                          least min_tag_count times in tags.csv
    dense     [3]         scaled release year, number of genres, log(1 + number of tags)

Split by time: ratings sorted by timestamp; the last ``test_fraction`` of them
are the test split, the ``eval_fraction`` before those the validation split, so
the model is scored on the future. (Tags are taken
over the whole file; they describe the movie, not the rating.)

A positive-unlabeled (PU) view for measuring PU learning: ``pu_hide_fraction``
of the positives of the train and validation splits, drawn at random with
``pu_seed`` (each positive independently, so the labelled positives are a
random sample of the positives), are relabelled 0; the test split keeps the
true labels, so its metrics are against the truth.

Periods (``towerrec replay``, ``periods`` >= 2; ``movielens_periods``): every
rating (train, validation and test splits: together the whole file in time
order) cut into ``periods`` slices of equal count (``period_by = "count"``) or
of equal calendar span between the first and the last rating
(``period_by = "calendar"``; a span without ratings is an error).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from towerrec.data.batch import DataSchema, SparseFeature
from towerrec.data.cache import ColumnStore, SplitColumns
from towerrec.data.periods import ColumnPeriods, count_bounds
from towerrec.utils import at_least, within

__all__ = [
    "MovieLensConfig",
    "bundled_movielens_path",
    "hide_positives",
    "load_movielens",
    "movielens_periods",
]

_YEAR = re.compile(r"\((\d{4})\)\s*$")
_REQUIRED = {
    "ratings.csv": ("userId", "movieId", "rating", "timestamp"),
    "movies.csv": ("movieId", "title", "genres"),
    "tags.csv": ("userId", "movieId", "tag", "timestamp"),
}


@dataclass(frozen=True)
class MovieLensConfig:
    """``data.movielens``: how ratings become clicks and how they are split."""

    min_rating: float = 4.0
    eval_fraction: float = 0.2  # the validation split: the latest ratings before test's
    min_tag_count: int = 2
    test_fraction: float = 0.0  # the test split: the latest ratings
    # PU view: this share of train and validation positives relabelled 0 (test keeps truth)
    pu_hide_fraction: float = 0.0
    pu_seed: int = 0
    periods: int = 0  # time slices for `towerrec replay`; 0 or 1: none
    period_by: str = "count"  # count: equal numbers of ratings; calendar: equal time spans

    def __post_init__(self) -> None:
        at_least("data.movielens.periods", self.periods, 0)
        if self.period_by not in ("count", "calendar"):
            raise ValueError(
                f"data.movielens.period_by must be 'count' or 'calendar', got {self.period_by!r}"
            )
        within(
            "data.movielens.pu_hide_fraction",
            self.pu_hide_fraction,
            "[0, 1)",
            hint="the share of train and validation positives relabelled 0; 0 = none",
        )
        within("data.movielens.eval_fraction", self.eval_fraction, "(0, 1)")
        if not 0 <= self.test_fraction < 1 or self.eval_fraction + self.test_fraction >= 1:
            raise ValueError(
                f"data.movielens.test_fraction must lie in [0, 1) and leave training rows "
                f"beside eval_fraction = {self.eval_fraction}, got {self.test_fraction}"
            )
        if self.min_tag_count < 1:
            raise ValueError("data.movielens.min_tag_count must be >= 1")


def bundled_movielens_path() -> Path:
    """``datasets/ml-latest-small`` of the source checkout this package runs from."""
    return Path(__file__).resolve().parents[3] / "datasets" / "ml-latest-small"


def _read(path: Path, name: str) -> pa.Table:
    file = path / name
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} does not exist; data.path must be a MovieLens directory with "
            f"{', '.join(_REQUIRED)} (the bundled one is datasets/ml-latest-small)"
        )
    try:
        table = pa_csv.read_csv(file)
    except pa.ArrowInvalid as e:
        raise ValueError(f"{file} is not a valid CSV file ({e})") from None
    missing = [c for c in _REQUIRED[name] if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{file} has no column {missing[0]!r} (columns: {table.column_names}); "
            f"MovieLens {name} needs {', '.join(_REQUIRED[name])}"
        )
    return table


def _index(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """1 + position of each value in sorted ``keys`` (0 when absent)."""
    at = np.minimum(np.searchsorted(keys, values), max(len(keys) - 1, 0))
    return np.where(keys[at] == values, at + 1, 0) if len(keys) else np.zeros_like(values)


def _bags(owner: np.ndarray, item: np.ndarray, num_owners: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-owner lists as (values sorted by owner, lengths [num_owners])."""
    order = np.lexsort((item, owner))
    return item[order], np.bincount(owner, minlength=num_owners)


def hide_positives(labels: np.ndarray, end: int, fraction: float, seed: int) -> np.ndarray:
    """``labels [N]`` with each positive among the first ``end`` rows relabelled 0 with
    probability ``fraction`` (independently, seeded by ``seed``); the rest unchanged."""
    if fraction == 0:
        return labels
    hidden = np.random.default_rng(seed).random(end) < fraction
    observed = labels.copy()
    observed[:end][hidden & (labels[:end] > 0)] = 0
    return observed


def load_movielens(path: str | Path, config: MovieLensConfig | None = None) -> ColumnStore:
    """In-memory columns of the whole data set, split by time (see module docstring)."""
    config = config or MovieLensConfig()
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"MovieLens directory {str(path)!r} does not exist; set data.path to a directory "
            "with ratings.csv, movies.csv and tags.csv (or leave it empty for the bundled one)"
        )
    ratings, movies, tags = (_read(path, name) for name in _REQUIRED)
    if ratings.num_rows < 2:
        raise ValueError(f"{path / 'ratings.csv'} has {ratings.num_rows} ratings; need at least 2")

    users = np.unique(ratings["userId"].to_numpy())
    movie_ids = movies["movieId"].to_numpy()
    movie_keys = np.unique(np.concatenate([movie_ids, ratings["movieId"].to_numpy()]))
    num_movies = len(movie_keys) + 1  # row 0: unknown movie

    # Per movie (indexed by 1 + position in movie_keys): year, genres, tags.
    movie_row = _index(movie_ids, movie_keys)
    years = np.zeros(num_movies, dtype=np.int64)
    for row, title in zip(movie_row, movies["title"].to_pylist()):
        match = _YEAR.search(title or "")
        if match:
            years[row] = int(match.group(1))
    known = years[years > 0]
    first_year = int(known.min()) if len(known) else 0
    year_ids = np.where(years > 0, years - first_year + 1, 0)

    genre_lists = [
        [] if g in (None, "(no genres listed)") else g.split("|")
        for g in movies["genres"].to_pylist()
    ]
    genre_names = sorted({g for gs in genre_lists for g in gs})
    genre_of = {g: i for i, g in enumerate(genre_names)}
    owners = np.array([r for r, gs in zip(movie_row, genre_lists) for _ in gs], dtype=np.int64)
    items = np.array([genre_of[g] for gs in genre_lists for g in gs], dtype=np.int64)
    genre_values, genre_lengths = _bags(owners, items, num_movies)

    tag_text = pc.utf8_lower(pc.utf8_trim_whitespace(tags["tag"].cast(pa.string())))
    tag_movie = _index(tags["movieId"].to_numpy(), movie_keys)
    names, tag_codes = np.unique(np.array(tag_text.to_pylist(), dtype=object), return_inverse=True)
    pairs = np.unique(np.stack([tag_movie, tag_codes]), axis=1)  # distinct (movie, tag)
    counts = np.bincount(tag_codes, minlength=len(names))
    kept = counts >= config.min_tag_count
    new_code = np.cumsum(kept) - 1
    pairs = pairs[:, kept[pairs[1]] & (pairs[0] > 0)]
    tag_values, tag_lengths = _bags(pairs[0], new_code[pairs[1]], num_movies)
    num_tags = max(int(kept.sum()), 1)

    # Ratings in time order; per-movie offsets to gather the multi-hot bags.
    order = np.argsort(ratings["timestamp"].to_numpy(), kind="stable")
    user = _index(ratings["userId"].to_numpy()[order], users)
    movie = _index(ratings["movieId"].to_numpy()[order], movie_keys)
    labels = (ratings["rating"].to_numpy()[order] >= config.min_rating).astype(np.float32)
    sparse = np.stack([user, movie, year_ids[movie]], axis=1).astype(np.int32)
    dense = np.stack(
        [
            np.where(years[movie] > 0, (years[movie] - 1990) / 20.0, 0.0),
            genre_lengths[movie],
            np.log1p(tag_lengths[movie]),
        ],
        axis=1,
    ).astype(np.float32)

    def gather(values: np.ndarray, lengths: np.ndarray, rows: np.ndarray):
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        take = lengths[rows]
        starts = np.repeat(offsets[rows] - np.concatenate([[0], np.cumsum(take)[:-1]]), take)
        return values[np.arange(int(take.sum())) + starts].astype(np.int32), take.astype(np.int32)

    n = len(order)
    test_cut = n - round(n * config.test_fraction)
    cut = test_cut - max(1, round(n * config.eval_fraction))
    labels = hide_positives(labels, test_cut, config.pu_hide_fraction, config.pu_seed)
    splits = {}
    bounds = {"train": (0, cut), "validation": (cut, test_cut), "test": (test_cut, n)}
    for split, (lo, hi) in bounds.items():
        rows = np.arange(lo, hi)
        splits[split] = [
            SplitColumns.from_arrays(
                labels[rows],
                dense[rows],
                sparse[rows],
                {
                    "genres": gather(genre_values, genre_lengths, movie[rows]),
                    "tags": gather(tag_values, tag_lengths, movie[rows]),
                },
            )
        ]

    def pooling(lengths: np.ndarray) -> float:
        return max(float(lengths[movie].mean()), 1.0)

    schema = DataSchema(
        num_dense=3,
        sparse=(
            SparseFeature("user", len(users) + 1),
            SparseFeature("movie", num_movies),
            SparseFeature("year", int(year_ids.max()) + 1),
            SparseFeature("genres", max(len(genre_names), 1), pooling(genre_lengths)),
            SparseFeature("tags", num_tags, pooling(tag_lengths)),
        ),
    )
    return ColumnStore(schema, ["user", "movie", "year"], ["genres", "tags"], splits)


def movielens_periods(path: str | Path, config: MovieLensConfig) -> ColumnPeriods:
    """Every rating in time order as ``config.periods`` periods (module docstring)."""
    store = load_movielens(path, config)
    parts = [p for split in ("train", "validation", "test") for p in store.splits[split]]
    rows = sum(p.rows for p in parts)
    if config.periods <= 1:
        return ColumnPeriods(store.schema, store.single, store.multi, parts, [0, rows])
    what = "data.movielens.periods"
    fix = "use fewer data.movielens.periods"
    if config.period_by == "count":
        bounds = count_bounds(rows, config.periods, what)
    else:
        stamps = np.sort(_read(Path(path), "ratings.csv")["timestamp"].to_numpy())
        count_bounds(rows, config.periods, what)  # periods > rows: the same error
        first, last = int(stamps[0]), int(stamps[-1])
        edges = [first + (last - first) * p / config.periods for p in range(1, config.periods)]
        bounds = [0, *np.searchsorted(stamps, edges, side="left").tolist(), rows]
        for p in range(config.periods):
            if bounds[p + 1] == bounds[p]:
                lo = first + (last - first) * p / config.periods
                hi = first + (last - first) * (p + 1) / config.periods
                raise ValueError(
                    f"data.movielens.period_by = 'calendar': period {p} "
                    f"({_day(lo)} to {_day(hi)}) has no ratings; use fewer "
                    "data.movielens.periods or period_by = 'count'"
                )
        fix += " or period_by = 'count'"
    return ColumnPeriods(store.schema, store.single, store.multi, parts, bounds, what, fix)


def _day(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d")
