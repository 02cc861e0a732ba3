"""Train, validation and test splits: converters' options, MovieLens by time, old caches."""

import json
import random

import numpy as np
import pytest

from towerrec.cli import main
from towerrec.data.cache import open_cache
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.data.loader import ColumnSource
from towerrec.data.movielens import MovieLensConfig, bundled_movielens_path, load_movielens
from towerrec.data.splits import split_rows


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    root = tmp_path_factory.mktemp("splits")
    return generate_criteo_files(root, files=3, rows_per_file=2000, seed=5)


def convert(days, out, *options):
    args = ["data", "criteo", *map(str, days), "--out", str(out), "--num-embeddings", "100"]
    assert main([*args, "--no-progress", *options]) == 0


def info(cache, capsys):
    capsys.readouterr()
    assert main(["data", "info", str(cache)]) == 0
    return json.loads(capsys.readouterr().out)


def labels(store, split):
    return np.concatenate([p.labels for p in store.splits.get(split, [])] or [np.zeros(0)])


def test_whole_files_go_to_validation_and_test(days, tmp_path, capsys):
    convert(days, tmp_path / "c", "--validation-files", "day_1", "--test-files", "day_2")
    assert "2,000 train, 2,000 validation and 2,000 test rows" in capsys.readouterr().out
    assert info(tmp_path / "c", capsys)["rows"] == {"train": 2000, "validation": 2000, "test": 2000}
    source = ColumnSource(open_cache(tmp_path / "c"), require_eval=True)
    assert (source.train_rows, source.eval_rows, source.test_rows) == (2000, 2000, 2000)
    test = [b.labels for b in source.test_batches(700)]
    assert [len(t) for t in test] == [700, 700, 600]
    # The test batches are day_2's rows, in file order.
    day_2 = [float(line.split("\t")[0]) for line in days[2].read_text().splitlines()]
    assert np.concatenate(test).tolist() == day_2


def test_test_options_alone_keep_the_default_validation_fraction(days, tmp_path, capsys):
    convert(days, tmp_path / "c", "--test-files", "day_2")
    out = capsys.readouterr().out
    assert "no validation option given: holding out a seeded 10% of the rows" in out
    rows = info(tmp_path / "c", capsys)["rows"]
    assert rows["test"] == 2000 and 300 < rows["validation"] < 500
    assert rows["train"] + rows["validation"] == 4000


def test_fractions_are_seeded_and_adding_test_keeps_validation(days, tmp_path, capsys):
    convert(days, tmp_path / "v", "--validation-fraction", "0.2")
    convert(days, tmp_path / "vt", "--validation-fraction", "0.2", "--test-fraction", "0.1")
    rows = info(tmp_path / "vt", capsys)["rows"]
    assert sum(rows.values()) == 6000
    assert 0.15 < rows["validation"] / 6000 < 0.25 and 0.06 < rows["test"] / 6000 < 0.14
    only, both = open_cache(tmp_path / "v"), open_cache(tmp_path / "vt")
    # The validation draw does not depend on the test fraction (one uniform per row).
    np.testing.assert_array_equal(labels(only, "validation"), labels(both, "validation"))
    assert only.rows("train") == both.rows("train") + both.rows("test")
    masks = split_rows(np.arange(10_000), 0.2, 0.1, seed=0, file_index=0)
    assert sum(masks.values()).tolist() == [1] * 10_000  # every row in exactly one split


def test_libfm_and_table_take_the_same_split_options(tmp_path, capsys):
    rng = random.Random(0)
    for name in ("a", "b"):
        lines = [f"{rng.randint(0, 1)} {rng.randrange(10)}:1" for _ in range(1000)]
        (tmp_path / f"{name}.libfm").write_text("\n".join(lines) + "\n")
        rows = ["click,user"] + [f"{rng.randint(0, 1)},u{rng.randrange(10)}" for _ in range(1000)]
        (tmp_path / f"{name}.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "fields.txt").write_text("user 0 9\n")
    libfm = ["data", "libfm", str(tmp_path / "a.libfm"), str(tmp_path / "b.libfm")]
    libfm += ["--fields", str(tmp_path / "fields.txt"), "--out", str(tmp_path / "l")]
    assert main([*libfm, "--test-files", "b.libfm", "--validation-fraction", "0.25"]) == 0
    rows = info(tmp_path / "l", capsys)["rows"]
    assert rows["test"] == 1000 and rows["train"] + rows["validation"] == 1000
    assert 150 < rows["validation"] < 350
    table = ["data", "table", str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--label"]
    table += ["click", "--categorical", "user:20", "--out", str(tmp_path / "t")]
    assert main([*table, "--validation-files", "a.csv", "--test-fraction", "0.5"]) == 0
    rows = info(tmp_path / "t", capsys)["rows"]
    assert rows["validation"] == 1000 and 400 < rows["test"] < 600
    assert rows["train"] + rows["test"] == 1000


@pytest.mark.parametrize(
    "options, message",
    [
        (["--validation-fraction", "0.6", "--test-fraction", "0.4"], "leave no training rows"),
        (["--test-fraction", "1"], "--test-fraction must lie in [0, 1)"),
        (["--validation-files", "day_1", "--test-files", "day_1"], "a file goes to one split"),
        (["--test-files", "day_9"], "--test-files ['day_9'] are not among the input files"),
    ],
)
def test_bad_split_options_are_one_error_line(days, tmp_path, capsys, options, message):
    args = ["data", "criteo", *map(str, days), "--out", str(tmp_path / "c"), "--no-progress"]
    assert main([*args, *options]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error:") and message in error, error


def test_a_cache_of_the_earlier_format_reads_its_eval_split_as_validation(days, tmp_path, capsys):
    cache = tmp_path / "old"
    convert(days[:2], cache, "--eval-files", "day_1")  # the option's earlier name
    # Rewrite it as earlier versions wrote it: one held-out split named "eval".
    manifest = json.loads((cache / "manifest.json").read_text())
    del manifest["manifest_sha256"]  # its digest of itself came later too
    manifest["rows"] = {"train": 2000, "eval": 2000}
    for part in manifest["parts"]:
        for old in list(part["files"]):
            if old.startswith("validation."):
                new = "eval." + old.removeprefix("validation.")
                (cache / "parts" / part["name"] / old).rename(cache / "parts" / part["name"] / new)
                part["files"][new] = part["files"].pop(old)
        part["rows"] = {("eval" if k == "validation" else k): v for k, v in part["rows"].items()}
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert not list(cache.glob("parts/*/validation.*"))
    assert info(cache, capsys)["rows"] == {"train": 2000, "validation": 2000, "test": 0}
    source = ColumnSource(open_cache(cache), require_eval=True)
    assert (source.eval_rows, source.test_rows) == (2000, 0)
    assert sum(b.size for b in source.eval_batches(512)) == 2000
    assert list(source.test_batches(512)) == []


def test_movielens_splits_by_time_into_train_validation_and_test():
    path = bundled_movielens_path()
    three = load_movielens(path, MovieLensConfig(eval_fraction=0.2, test_fraction=0.1))
    two = load_movielens(path, MovieLensConfig(eval_fraction=0.3))
    n = two.rows("train") + two.rows("validation")
    assert three.rows("test") == round(n * 0.1) and three.rows("validation") == round(n * 0.2)
    assert three.rows("train") == two.rows("train")
    # Validation then test are the latest ratings, in time order.
    held_out = np.concatenate([labels(three, "validation"), labels(three, "test")])
    np.testing.assert_array_equal(held_out, labels(two, "validation"))
    with pytest.raises(ValueError, match="test_fraction"):
        MovieLensConfig(eval_fraction=0.5, test_fraction=0.5)
