"""Preprocess then train, through the library and the real command line."""

import json

import pytest
from conftest import run_cli

from towerrec.cli import main
from towerrec.config import load_config
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.train import trainer


def towerrec(*args):
    return run_cli(*args, OMP_NUM_THREADS="1")


SMALL = [
    "train.batch_size=128",
    "train.eval_every=0",
    "train.log_every=2",
    "train.progress=false",
    "train.eval_batch_size=4096",
    "optimizer.warmup_steps=2",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
]


@pytest.fixture(scope="module")
def criteo_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("criteo-e2e")
    days = generate_criteo_files(root / "raw", files=2, rows_per_file=4000, seed=3)
    options = CriteoOptions(num_embeddings=(500,), eval_files=("day_1",))
    preprocess_criteo(days, root / "cache", options, progress=False)
    return root / "cache"


def records(run, kind):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_resumed_run_continues_the_data_stream(criteo_cache, tmp_path):
    config = load_config(
        None, [*SMALL, "data.source=criteo", f"data.path={criteo_cache}", "train.steps=8"]
    )
    full = trainer.train(config, tmp_path / "full")
    trainer.train(config, tmp_path / "split", stop_after=4)
    resumed = trainer.train(config, tmp_path / "split", resume=True)
    assert resumed["completed"] and resumed["auc"] == full["auc"]
    losses = [r["loss"] for r in records(tmp_path / "full", "train")]
    assert [r["loss"] for r in records(tmp_path / "split", "train")] == losses
    assert len(set(losses)) == len(losses)  # batches differ from step to step


def test_cli_generate_preprocess_train(tmp_path, capsys):
    raw, cache, run = tmp_path / "raw", tmp_path / "cache", tmp_path / "run"
    result = towerrec("data", "gen-criteo", "--out", str(raw), "--files", "2", "--rows", "6000")
    assert result.returncode == 0, result.stderr
    result = towerrec(
        "data", "criteo", str(raw / "day_0"), str(raw / "day_1"), "--out", str(cache),
        "--eval-files", "day_1", "--num-embeddings", "1000", "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "6,000 train and 6,000 eval rows" in result.stdout
    assert main(["data", "info", str(cache)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == {"train": 6000, "eval": 6000} and info["checksums"] == "ok"
    sets = [f"--set={s}" for s in SMALL]
    result = towerrec(
        "train", "--out", str(run), "--set", "data.source=criteo", "--set", f"data.path={cache}",
        "--set", "train.steps=40", *sets,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["auc"] > 0.55  # the generator plants a signal
    assert summary["num_embedding_params"] == 26 * 1000 * 8


def test_cli_bad_data_is_one_error_line(tmp_path, criteo_cache, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\t3\n")
    # Through the real entry point once, then in-process through the same main().
    result = towerrec("data", "criteo", str(bad), "--out", str(tmp_path / "c"), "--strict")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:1: wrong field count")
    assert "Traceback" not in result.stderr
    # A corrupt cache is refused by `towerrec train` with a message to rebuild it.
    part = next((criteo_cache / "parts").iterdir()) / "train.dense.bin"
    original = part.read_bytes()
    part.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    cases = [
        (["data", "criteo", str(tmp_path / "nope"), "--out", str(tmp_path / "c")],
         "does not exist"),
        (["train", "--set", "data.source=criteo"], "needs data.path"),
        (["train", "--set", "data.source=criteo", "--set", f"data.path={tmp_path}",
          "--out", str(tmp_path / "r1")], "no manifest.json"),
        (["data", "criteo", str(bad), "--out", str(tmp_path / "c2")], "no valid rows"),
        (["train", "--set", "data.source=criteo", "--set", f"data.path={criteo_cache}",
          "--out", str(tmp_path / "r2")], "rebuild it"),
    ]  # fmt: skip
    try:
        for args, needle in cases:
            assert main(args) == 2, args
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith("error:") and needle in err[-1], (args, err)
    finally:
        part.write_bytes(original)
