"""libFM with a field map, Parquet and CSV with a declared schema: caches against the inputs."""

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from towerrec.data.cache import open_cache
from towerrec.data.libfm import preprocess_libfm, read_field_map
from towerrec.data.loader import ColumnSource, LoaderConfig
from towerrec.data.tabular import TableSchema, preprocess_table
from towerrec.data.text_input import MalformedInputError

FIELDS = """# name first last kind
user 0 9
item 10 29
context 30 34 multi
price 35 36 dense
"""


def hashed(text, size):
    return 1 + int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % (
        size - 1
    )


def all_rows(path):
    source = ColumnSource(open_cache(path), LoaderConfig(dense="none", shuffle=False))
    return source.train_batch(0, source.train_rows)


def test_libfm_fields_and_bad_lines(tmp_path):
    (tmp_path / "fields.txt").write_text(FIELDS)
    lines = [
        "1 3:1 12:1 31:1 33:1 35:0.5",
        "-1 0:1 29:1",
        "1 3:1 4:1 12:1",  # two ids in a single-hot field
        "0 3:1 99:1",  # index in no field
        "x 3:1",  # label
        "0 3:1 12",  # token without a value
        "1 9:1 10:1 34:1 36:2.5",
    ]
    (tmp_path / "train.libfm").write_text("\n".join(lines) + "\n")
    manifest = preprocess_libfm(
        [tmp_path / "train.libfm"], tmp_path / "cache", tmp_path / "fields.txt"
    )
    assert manifest["rows"]["train"] == 3
    positions = [p.split(": ")[0].rsplit(":", 1)[1] for p in manifest["report"]["first"]]
    assert positions == ["3", "4", "5", "6"]
    batch = all_rows(tmp_path / "cache")
    assert batch.labels.tolist() == [1.0, 0.0, 1.0]
    assert batch.sparse.keys() == ["user", "item", "context"]
    assert batch.sparse["user"].values.tolist() == [4, 1, 10]
    assert batch.sparse["item"].values.tolist() == [3, 20, 1]
    assert batch.sparse["context"].lengths.tolist() == [2, 0, 1]
    assert batch.sparse["context"].values.tolist() == [1, 3, 4]
    assert batch.dense.tolist() == [[0.5, 0.0], [0.0, 0.0], [0.0, 2.5]]
    schema = open_cache(tmp_path / "cache").schema
    assert [f.num_embeddings for f in schema.sparse] == [11, 21, 5]
    with pytest.raises(MalformedInputError, match=r"train\.libfm:3: single-hot field 'user'"):
        preprocess_libfm(
            [tmp_path / "train.libfm"], tmp_path / "c2", tmp_path / "fields.txt", strict=True
        )


def test_field_map_errors(tmp_path):
    path = tmp_path / "fields.txt"
    path.write_text("user 0 9\nitem 5 20\n")
    with pytest.raises(ValueError, match=r"'user' and 'item' overlap at indices 5\.\.9"):
        read_field_map(path)
    path.write_text("user 0 9\nitem 12 20\n")
    with pytest.raises(ValueError, match=r"indices 10\.\.11 between fields 'user' and 'item'"):
        read_field_map(path)
    path.write_text("user 0\n")
    with pytest.raises(ValueError, match=r"fields\.txt:1: expected 'name first last"):
        read_field_map(path)


@pytest.fixture
def frame():
    return {
        "click": [1, 0, 1, 0, 1, 1],
        "age": [21.0, None, 40.0, 33.0, 18.0, 50.0],
        "user": ["u1", "u2", None, "u1", "u3", "u2"],
        "genres": [["a", "b"], [], None, ["c"], ["a"], ["b", "c", "a"]],
    }


SCHEMA = TableSchema(
    label="click", dense=("age",), categorical={"user": 101}, multi_hot={"genres": 13}
)


def check_cache(path, frame):
    batch = all_rows(path)
    assert batch.labels.tolist() == [float(v) for v in frame["click"]]
    assert batch.dense[:, 0].tolist() == [v or 0.0 for v in frame["age"]]
    assert batch.sparse["user"].values.tolist() == [
        0 if u is None else hashed(u, 101) for u in frame["user"]
    ]
    bags = [g or [] for g in frame["genres"]]
    assert batch.sparse["genres"].lengths.tolist() == [len(b) for b in bags]
    assert batch.sparse["genres"].values.tolist() == [hashed(g, 13) for b in bags for g in b]


def test_parquet_and_csv_give_the_same_cache(tmp_path, frame):
    pq.write_table(pa.table(frame), tmp_path / "a.parquet")
    preprocess_table([tmp_path / "a.parquet"], tmp_path / "pq", SCHEMA)
    check_cache(tmp_path / "pq", frame)
    csv_lines = ["click,age,user,genres,unused"] + [
        f"{c},{'' if a is None else a},{u or ''},{'|'.join(g or [])},x"
        for c, a, u, g in zip(*frame.values())
    ]
    (tmp_path / "a.csv").write_text("\n".join(csv_lines) + "\n")
    preprocess_table([tmp_path / "a.csv"], tmp_path / "csv", SCHEMA)
    check_cache(tmp_path / "csv", frame)
    schema = open_cache(tmp_path / "csv").schema
    assert schema.sparse[1].pooling_factor == pytest.approx(max(7 / 6, 1.0))


def test_missing_column_and_bad_values(tmp_path, frame):
    del frame["age"]
    pq.write_table(pa.table(frame), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"has no column 'age' declared in the schema"):
        preprocess_table([tmp_path / "a.parquet"], tmp_path / "c", SCHEMA)
    lines = ["click,age,user,genres", "1,3,u,a", "1,old,u,a", "7,3,u,a", "0,4,v,"]
    (tmp_path / "b.csv").write_text("\n".join(lines) + "\n")
    manifest = preprocess_table([tmp_path / "b.csv"], tmp_path / "c2", SCHEMA)
    assert manifest["rows"]["train"] == 2
    assert [p.split(": ")[1] for p in manifest["report"]["first"]] == [
        "age is not a finite number",
        "label click is not 0 or 1",
    ]
    assert [p.split(": ")[0].rsplit(":", 1)[1] for p in manifest["report"]["first"]] == ["3", "4"]
    with pytest.raises(ValueError, match="at least one categorical"):
        TableSchema(label="click")


def test_a_csv_cache_trains(tmp_path):
    from towerrec.config import load_config
    from towerrec.workflows import training as trainer

    rng = np.random.default_rng(0)
    users, items = rng.integers(0, 50, 3000), rng.integers(0, 80, 3000)
    clicks = rng.random(3000) < 1 / (1 + np.exp(-3 * (np.sin(users) + np.cos(items))))
    lines = ["click,user,item,tags"] + [
        f"{int(c)},u{u},i{i},t{u % 5}|t{i % 7}" for c, u, i in zip(clicks, users, items)
    ]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    schema = TableSchema(
        label="click", categorical={"user": 100, "item": 100}, multi_hot={"tags": 50}
    )
    preprocess_table([tmp_path / "a.csv"], tmp_path / "cache", schema, eval_fraction=0.2)
    config = load_config(
        None,
        [
            "data.source=cache",
            f"data.path={tmp_path / 'cache'}",
            "train.steps=40",
            "model.bottom_mlp=[]",  # no dense features
            "train.batch_size=128",
            "train.eval_every=0",
            "train.progress=false",
            "optimizer.warmup_steps=2",
        ],
    )
    summary = trainer.train(config, tmp_path / "run")
    assert summary["auc"] > 0.6  # no dense features: ids and the tag bags carry the signal


def test_infer_fields_writes_a_map_that_converts_the_data(tmp_path):
    """One token per field per line (a Frappe-style export): the inferred map gives each
    position its index range, a one-index position with varying values is dense, and the
    printed command converts the data with it."""
    import random

    rng = random.Random(0)
    lines = [
        f"{rng.choice((-1, 1))} {rng.randrange(2, 10)}:1 {rng.randrange(10, 30)}:1 "
        f"{rng.randrange(30, 35)}:1 35:{rng.random():.3f}"
        for _ in range(200)
    ]
    (tmp_path / "train.libfm").write_text("\n".join(lines) + "\n")
    result = run_cli("data", "libfm", "train.libfm", "--infer-fields", "fields.txt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    fields = read_field_map(tmp_path / "fields.txt")
    assert fields.kinds == ("single", "single", "single", "dense")
    assert fields.firsts[0] == 0 and fields.lasts[-1] == 35
    command = result.stdout.strip().splitlines()[-1].removeprefix("convert with: towerrec ")
    result = run_cli(*command.replace("DIR", "cache").split(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    schema = open_cache(tmp_path / "cache").schema
    assert schema.num_dense == 1 and len(schema.sparse) == 3


def test_infer_fields_refuses_lines_without_one_token_per_field(tmp_path):
    (tmp_path / "train.libfm").write_text("1 3:1 12:1\n0 4:1 13:1 31:1\n")
    result = run_cli("data", "libfm", "train.libfm", "--infer-fields", "f.txt", cwd=tmp_path)
    assert result.returncode == 2
    assert "train.libfm:2: 3 idx:val tokens where earlier lines have 2" in result.stderr
    result = run_cli("data", "libfm", "train.libfm", cwd=tmp_path)
    assert result.returncode == 2 and "needs --fields FILE and --out DIR" in result.stderr
