"""A small-vocabulary, context-aware click data set built from MovieLens, in libFM files
(``towerrec data gen-context``).

Public CTR benchmarks of this shape (Frappe, MovieLens-tag: ten or so one-hot fields,
tables of a few rows to a few thousand, negatives sampled for each logged positive)
are where an embedding's initial scale matters most: a 3-row table started at
±sqrt(1/3) is far from where it ends. This data set has that shape and is rebuilt from
the bundled ml-latest-small by anyone::

    positive  a rating >= min_rating: the user watched and liked the movie, in the
              context of the rating's time
    negative  ``negatives`` per positive: the same user and context with a movie drawn
              uniformly from those the user never rated (seeded)

    field       rows   from
    user         611   userId
    movie      9,743   movieId (every movie of movies.csv)
    genre         20   the first genre listed
    genres        11   number of genres listed (1 .. 10)
    decade        15   release decade from the title, "(1995)", 1890s .. 2010s; 0: unknown
    tagged         3   whether anyone tagged the movie in tags.csv
    year          24   year of the rating (1996 .. 2018)
    weekday        8   day of the week of the rating (UTC)
    weekend        3   Saturday or Sunday
    daytime        5   night, morning, afternoon, evening (UTC hours 0-5, 6-11, ...)

(rows: a field's values plus the id 0 that libFM conversion reserves for "absent").
The rows are shuffled (seeded) and cut into ``train.libfm``, ``validation.libfm`` and
``test.libfm`` (70/20/10, as the BARS benchmarks split their small sets), written with
``fields.txt``, the field map ``towerrec data libfm`` reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.csv as pa_csv

from towerrec.utils import at_least, within

__all__ = ["FIELDS", "ContextOptions", "generate_context_files"]

FIELDS = (
    "user",
    "movie",
    "genre",
    "genres",
    "decade",
    "tagged",
    "year",
    "weekday",
    "weekend",
    "daytime",
)
SPLITS = {"train": 0.7, "validation": 0.2, "test": 0.1}
_YEAR = re.compile(r"\((\d{4})\)\s*$")
_FIRST_DECADE, _DECADES = 1890, 13  # 1890s .. 2010s
_FIRST_YEAR, _YEARS = 1996, 23  # ratings from 1996 to 2018


@dataclass(frozen=True)
class ContextOptions:
    """``min_rating``: a rating at least this is a positive; ``negatives`` sampled per
    positive; ``seed``: the negatives and the split."""

    min_rating: float = 4.0
    negatives: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        within("--min-rating", self.min_rating, "[0.5, 5]")
        at_least("--negatives", self.negatives, 1)


def _csv(path: Path, name: str) -> dict[str, np.ndarray]:
    file = path / name
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} does not exist; --movielens must be a MovieLens directory with "
            "ratings.csv, movies.csv and tags.csv (the bundled one is datasets/ml-latest-small)"
        )
    table = pa_csv.read_csv(file)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def _movie_fields(movielens: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Sorted movie ids and each movie's genre, genres, decade and tagged values."""
    movies, tags = _csv(movielens, "movies.csv"), _csv(movielens, "tags.csv")
    order = np.argsort(movies["movieId"])
    ids = movies["movieId"][order]
    lists = [str(g).split("|") for g in movies["genres"][order]]
    names = sorted({g[0] for g in lists})
    genre = np.array([names.index(g[0]) for g in lists])
    genres = np.array([min(len(g), 10) - 1 for g in lists])
    decade = np.zeros(len(ids), dtype=np.int64)  # 0: unknown
    for i, title in enumerate(movies["title"][order]):
        found = _YEAR.search(str(title))
        if found:
            decade[i] = 1 + min(max(int(found.group(1)) // 10 * 10 - _FIRST_DECADE, 0) // 10, 12)
    tagged = np.isin(ids, tags["movieId"]).astype(np.int64)
    return ids, {"genre": genre, "genres": genres, "decade": decade, "tagged": tagged}


def _sizes(genre_names: int) -> dict[str, int]:
    return {"genre": genre_names, "genres": 10, "decade": _DECADES + 1, "tagged": 2}


def generate_context_files(
    movielens: str | Path, out: str | Path, options: ContextOptions | None = None
) -> dict[str, int]:
    """Write the data set (module doc) into ``out``; returns each split's rows."""
    options = options or ContextOptions()
    movielens, out = Path(movielens), Path(out)
    ratings = _csv(movielens, "ratings.csv")
    movie_ids, movie_fields = _movie_fields(movielens)
    users = np.unique(ratings["userId"])
    user = np.searchsorted(users, ratings["userId"])
    movie = np.searchsorted(movie_ids, ratings["movieId"])
    if not np.array_equal(movie_ids[np.minimum(movie, len(movie_ids) - 1)], ratings["movieId"]):
        raise ValueError(f"{movielens}/ratings.csv rates movies that movies.csv does not list")
    liked = ratings["rating"] >= options.min_rating
    rng = np.random.default_rng(options.seed)
    rated = np.unique(user * len(movie_ids) + movie)
    pos = np.flatnonzero(liked)
    rows_user = np.repeat(user[pos], 1 + options.negatives)
    rows_time = np.repeat(ratings["timestamp"][pos].astype("int64"), 1 + options.negatives)
    rows_movie = np.empty(len(rows_user), dtype=np.int64)
    label = np.zeros(len(rows_user), dtype=np.int64)
    label[:: 1 + options.negatives] = 1
    rows_movie[:: 1 + options.negatives] = movie[pos]
    for k in range(1, 1 + options.negatives):
        at = np.arange(k, len(rows_user), 1 + options.negatives)
        drawn = rng.integers(0, len(movie_ids), len(at))
        while True:  # redraw the movies the user rated
            clash = np.isin(rows_user[at] * len(movie_ids) + drawn, rated)
            if not clash.any():
                break
            drawn[clash] = rng.integers(0, len(movie_ids), int(clash.sum()))
        rows_movie[at] = drawn
    stamp = rows_time.astype("datetime64[s]")
    days = stamp.astype("datetime64[D]").astype(np.int64)
    weekday = (days + 3) % 7  # 1970-01-01 was a Thursday: 0 = Monday
    hour = (rows_time // 3600) % 24
    year = np.clip(stamp.astype("datetime64[Y]").astype(np.int64) + 1970 - _FIRST_YEAR, 0, 22)
    values = {
        "user": (rows_user, len(users)),
        "movie": (rows_movie, len(movie_ids)),
        **{
            name: (movie_fields[name][rows_movie], size)
            for name, size in _sizes(int(movie_fields["genre"].max()) + 1).items()
        },
        "year": (year, _YEARS),
        "weekday": (weekday, 7),
        "weekend": ((weekday >= 5).astype(np.int64), 2),
        "daytime": (hour // 6, 4),
    }
    out.mkdir(parents=True, exist_ok=True)
    first, field_lines, columns = 0, [], []
    for name in FIELDS:
        column, size = values[name]
        field_lines.append(f"{name} {first} {first + size - 1} single")
        columns.append((column + first).astype(str))
        first += size
    (out / "fields.txt").write_text("\n".join(field_lines) + "\n")
    order = rng.permutation(len(label))
    bounds = np.cumsum([round(share * len(label)) for share in SPLITS.values()])[:-1]
    rows = {}
    for split, part in zip(SPLITS, np.split(order, bounds)):
        lines = [label[part].astype(str)] + [np.char.add(c[part], ":1") for c in columns]
        text = "\n".join(" ".join(cells) for cells in zip(*lines)) + "\n"
        (out / f"{split}.libfm").write_text(text)
        rows[split] = len(part)
    return rows
