"""MovieLens as a click task: samples against a csv-module reading of the bundled files."""

import csv
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from towerrec.config import load_config
from towerrec.data.loader import ColumnSource, LoaderConfig
from towerrec.data.movielens import MovieLensConfig, bundled_movielens_path, load_movielens
from towerrec.workflows import training as trainer

PATH = bundled_movielens_path()
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def store():
    return load_movielens(PATH)


def read_csv(name):
    with open(PATH / name, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_bundled_with_its_licence():
    readme = (PATH / "README.txt").read_text(encoding="utf-8")
    assert "redistribute" in readme and "GroupLens" in readme


def test_samples_match_the_csv_files(store):
    ratings = read_csv("ratings.csv")
    movies = {int(m["movieId"]): m for m in read_csv("movies.csv")}
    tags = read_csv("tags.csv")
    assert store.rows("train") + store.rows("eval") == len(ratings)
    assert store.rows("eval") == round(len(ratings) * 0.2)

    ordered = sorted(ratings, key=lambda r: int(r["timestamp"]))  # the sort is stable
    users = sorted({int(r["userId"]) for r in ratings})
    movie_keys = sorted(set(movies) | {int(r["movieId"]) for r in ratings})
    tag_counts = {}
    for t in tags:
        name = t["tag"].strip().lower()
        tag_counts[name] = tag_counts.get(name, 0) + 1
    kept_tags = sorted(n for n, c in tag_counts.items() if c >= 2)
    genre_names = sorted(
        {g for m in movies.values() for g in m["genres"].split("|")} - {"(no genres listed)"}
    )
    # Train split in file order (no shuffle): check a spread of samples.
    source = ColumnSource(store, LoaderConfig(dense="none", shuffle=False))
    batch = source.train_batch(0, store.rows("train"))
    picks = [0, 1, 17, 5000, 40_000, store.rows("train") - 1]
    features = batch.sparse.to_dict()
    offsets = {k: np.concatenate([[0], np.cumsum(j.lengths.numpy())]) for k, j in features.items()}
    for i in picks:
        rating = ordered[i]
        movie_id = int(rating["movieId"])
        assert batch.labels[i] == float(float(rating["rating"]) >= 4.0)
        assert features["user"].values[i] == users.index(int(rating["userId"])) + 1
        assert features["movie"].values[i] == movie_keys.index(movie_id) + 1
        genres = movies[movie_id]["genres"].split("|")
        expected = sorted(genre_names.index(g) for g in genres if g in genre_names)
        got = features["genres"].values[offsets["genres"][i] : offsets["genres"][i + 1]]
        assert sorted(got.tolist()) == expected
        movie_tags = {t["tag"].strip().lower() for t in tags if int(t["movieId"]) == movie_id}
        expected = sorted(kept_tags.index(t) for t in movie_tags if t in kept_tags)
        got = features["tags"].values[offsets["tags"][i] : offsets["tags"][i + 1]]
        assert sorted(got.tolist()) == expected
        year = re.search(r"\((\d{4})\)\s*$", movies[movie_id]["title"])
        assert (features["year"].values[i] > 0) == (year is not None)
        assert batch.dense[i, 1] == len([g for g in genres if g in genre_names])


def test_split_is_by_time(store):
    source = ColumnSource(store, LoaderConfig(dense="none", shuffle=False))
    ratings = sorted(int(r["timestamp"]) for r in read_csv("ratings.csv"))
    cut = store.rows("train")
    assert ratings[cut - 1] <= ratings[cut]
    evaluation = list(source.eval_batches(50_000))
    assert sum(b.size for b in evaluation) == store.rows("eval")
    for key in ("genres", "tags"):  # real pooled multi-id features
        assert (
            store.schema.sparse[[f.name for f in store.schema.sparse].index(key)].pooling_factor > 1
        )


def test_bad_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_movielens(tmp_path / "nope")
    copy = tmp_path / "ml"
    shutil.copytree(PATH, copy)
    (copy / "tags.csv").unlink()
    with pytest.raises(FileNotFoundError, match=r"tags\.csv does not exist"):
        load_movielens(copy)
    shutil.copy(PATH / "tags.csv", copy / "tags.csv")
    lines = (copy / "ratings.csv").read_text().splitlines()
    (copy / "ratings.csv").write_text(
        "\n".join(["userId,movieId,score,timestamp", *lines[1:]]) + "\n"
    )
    with pytest.raises(ValueError, match="has no column 'rating'"):
        load_movielens(copy)
    with pytest.raises(ValueError, match="eval_fraction"):
        MovieLensConfig(eval_fraction=0.0)


def test_movielens_config_trains(tmp_path):
    config = load_config(
        ROOT / "configs" / "movielens.toml",
        ["train.steps=30", "train.eval_every=0", "train.progress=false"],
    )
    assert config.data.source == "movielens"
    summary = trainer.train(config, tmp_path)
    assert summary["steps"] == 30 and summary["auc"] > 0.6
    assert json.loads((tmp_path / "summary.json").read_text())["auc"] == summary["auc"]
