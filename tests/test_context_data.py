"""``towerrec data gen-context``: the small-vocabulary libFM data set built from MovieLens
(data/context_gen.py), on a tiny MovieLens directory: what it writes, that it is seeded,
that negatives are movies the user never rated, and that the printed command converts it."""

import shlex

import pytest
from conftest import run_cli

from towerrec.data.context_gen import FIELDS, ContextOptions, generate_context_files

MOVIES = """movieId,title,genres
1,Toy Story (1995),Adventure|Animation|Children|Comedy|Fantasy
2,Heat (1995),Action|Crime|Thriller
5,Metropolis (1927),Drama|Sci-Fi
7,Untitled,(no genres listed)
9,Up (2009),Adventure|Animation
"""
TAGS = """userId,movieId,tag,timestamp
1,2,slow,964982703
"""


def tiny_movielens(path, users=30):
    """``users`` users who each rate movies 1 and 5 (liked) and 2 (not liked)."""
    rows = ["userId,movieId,rating,timestamp"]
    for u in range(1, users + 1):
        t = 964_982_703 + 86_400 * 37 * u  # days and hours that vary
        rows += [f"{u},1,{4.0 + u % 2},{t}", f"{u},2,{2.5},{t + 7_300}", f"{u},5,4.5,{t + 99}"]
    path.mkdir()
    (path / "ratings.csv").write_text("\n".join(rows) + "\n")
    (path / "movies.csv").write_text(MOVIES)
    (path / "tags.csv").write_text(TAGS)
    return path


def read_rows(path):
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(int(w[0]), [int(t.split(":")[0]) for t in w[1:]]) for w in lines]


def test_writes_one_token_per_field_split_70_20_10_with_sampled_negatives(tmp_path):
    ml = tiny_movielens(tmp_path / "ml")
    rows = generate_context_files(ml, tmp_path / "ctx", ContextOptions(negatives=2, seed=3))
    positives = 30 + 30  # movies 1 and 5 of every user
    assert sum(rows.values()) == 3 * positives
    assert rows == {"train": 126, "validation": 36, "test": 18}
    fields = [line.split() for line in (tmp_path / "ctx/fields.txt").read_text().splitlines()]
    assert [f[0] for f in fields] == list(FIELDS)
    assert [int(f[2]) - int(f[1]) + 1 for f in fields][:2] == [30, 5]  # users, movies
    first = {f[0]: int(f[1]) for f in fields}
    everything = []
    for split in rows:
        everything += read_rows(tmp_path / f"ctx/{split}.libfm")
    for label, tokens in everything:
        assert len(tokens) == len(FIELDS)
        assert all(int(f[1]) <= t <= int(f[2]) for t, f in zip(tokens, fields))
        movie = tokens[1] - first["movie"]  # index among sorted ids 1, 2, 5, 7, 9
        if label == 0:  # never a movie the user rated (1, 2 and 5 are rated by everyone)
            assert movie in (3, 4)
    assert sum(label for label, _ in everything) == positives


def test_is_seeded(tmp_path):
    ml = tiny_movielens(tmp_path / "ml")
    texts = []
    for seed, out in ((0, "a"), (0, "b"), (1, "c")):
        generate_context_files(ml, tmp_path / out, ContextOptions(seed=seed))
        texts.append((tmp_path / out / "train.libfm").read_text())
    assert texts[0] == texts[1] != texts[2]


def test_printed_command_converts_it_into_a_cache_with_a_test_split(tmp_path):
    ml = tiny_movielens(tmp_path / "ml")
    gen = run_cli("data", "gen-context", "--movielens", str(ml), "--out", str(tmp_path / "ctx"))
    assert gen.returncode == 0, gen.stderr
    command = next(line for line in gen.stdout.splitlines() if line.startswith("convert with: "))
    convert = run_cli(*shlex.split(command.removeprefix("convert with: towerrec ")))
    assert convert.returncode == 0, convert.stderr
    assert "126 train, 36 validation and 18 test rows" in convert.stdout
    # one-hot fields and small tables, but 126 training rows are few lookups a table row:
    # the large-vocabulary recipe (the bundled MovieLens' set, 98 a row, gets `context`)
    assert "training lookups per table row" in convert.stdout
    assert "train with: towerrec train --config criteo --set data.path=" in convert.stdout
    info = run_cli("data", "info", str(tmp_path / "ctx-cache"))
    assert '"weekend": 3' in info.stdout and '"movie": 6' in info.stdout


@pytest.mark.parametrize(
    "options, match",
    [({"negatives": 0}, r"--negatives must be >= 1"), ({"min_rating": 6.0}, r"--min-rating")],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        ContextOptions(**options)


def test_a_directory_without_movielens_files_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"ratings.csv does not exist; --movielens must"):
        generate_context_files(tmp_path, tmp_path / "out")
