"""End to end through the real command line."""

import json
import os
import subprocess
import sys
import tomllib

from conftest import ROOT
from conftest import run_cli as towerrec


def test_train_quick_config_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = towerrec(
        "train",
        "--config",
        "configs/quick.toml",
        "--out",
        str(out),
        "--set",
        "train.progress=false",
    )
    assert result.returncode == 0, result.stderr
    assert "oracle AUC" in result.stdout
    # Progress on stderr, results on stdout.
    assert "validation AUC" in result.stderr and "validation AUC" not in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60 and 0.5 < summary["auc"] <= summary["oracle_auc"] + 0.02
    assert "WARNING" not in result.stderr  # the bundled config's warm-up fits its steps
    assert (out / "curves.png").stat().st_size > 1000
    shown = towerrec(
        "config", "show", "--config", "configs/quick.toml", "--set", "train.progress=false"
    )
    assert shown.returncode == 0, shown.stderr
    # what the run recorded: the shown config with its `auto` kernel and precision resolved
    recorded = (out / "config.toml").read_text()
    chosen = tomllib.loads(recorded)["embedding"]["backend"]
    precision = tomllib.loads(recorded)["train"]["precision"]
    assert chosen in ("torch", "fbgemm") and precision in ("fp32", "bf16"), (chosen, precision)
    resolved = shown.stdout.replace('backend = "auto"', f'backend = "{chosen}"', 1)
    assert resolved.replace('precision = "auto"', f'precision = "{precision}"', 1) == recorded


def test_config_show_resolves_files_and_overrides():
    plain = towerrec("config", "show")
    assert plain.returncode == 0, plain.stderr
    assert "steps = 2500" in plain.stdout  # resolved, as a run records it
    assert "eval_batch_size = 16384" in plain.stdout
    assert towerrec("config", "show", "--config", "configs/default.toml").stdout == plain.stdout
    changed = towerrec("config", "show", "--set", "model.dcn.rank=4", "--set", "train.steps=7")
    assert changed.stdout == plain.stdout.replace("steps = 2500", "steps = 7").replace(
        "rank = 0\n", "rank = 4\n", 1
    )
    bad = towerrec("config", "show", "--set", "model.dcn.rnak=4")
    assert bad.returncode == 2 and "unknown config key 'model.dcn.rnak'" in bad.stderr


def test_train_with_adam_embeddings(tmp_path):
    out = tmp_path / "run"
    result = towerrec(
        "train",
        "--config",
        "configs/quick.toml",
        "--out",
        str(out),
        *("--set", "train.steps=5", "--set", "train.progress=false"),
        *("--set", "embedding.optimizer=adam", "--set", "embedding.weight_decay=0.01"),
        *("--set", "embedding.adam_betas=[0.9, 0.99]"),
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 5


def test_user_errors_exit_2_with_one_line(tmp_path):
    for args, needle in (
        (["train", "--set", "train.stepz=3"], "unknown config key 'train.stepz'"),
        (["train", "--config", str(tmp_path / "missing.toml")], "does not exist"),
        (["train", "--set", "model.bottom_mlp=[8, 4]"], "must end at model.embedding_dim"),
    ):
        result = towerrec(*args)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().startswith("error:") and needle in result.stderr
        assert "Traceback" not in result.stderr


def test_failed_run_leaves_no_directory_behind(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--config", "configs/quick.toml", "--out", str(out)]
    bad = ["--set", "data.source=criteo", "--set", f"data.path={tmp_path / 'missing'}"]
    result = towerrec(*args, *bad)  # the data is opened after the run directory is made
    assert result.returncode == 2 and "is not a directory" in result.stderr, result.stderr
    assert not out.exists()  # nothing to resume: the same --out works on the next try
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = towerrec(*args, *bad)
    assert result.returncode == 2 and (out / "notes.txt").read_text() == "mine"


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(tmp_path):
    """``towerrec data info DIR | head``: no BrokenPipeError traceback, status 141."""
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo
    from towerrec.data.criteo_gen import generate_criteo_files

    days = generate_criteo_files(tmp_path / "raw", files=1, rows_per_file=100)
    preprocess_criteo(days, tmp_path / "cache", CriteoOptions(num_embeddings=(50,)), False)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a byte: every write fails
    try:
        result = subprocess.run(
            [sys.executable, "-m", "towerrec.cli", "data", "info", str(tmp_path / "cache")],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
    finally:
        os.close(write)
    assert result.returncode == 141, result.stderr
    assert result.stderr == ""


def test_warnings_print_as_one_line_without_python_source(tmp_path):
    result = towerrec(
        "replay", "--config", "configs/quick.toml", "--out", str(tmp_path / "r"),
        "--set", "data.synthetic.periods=2", "--set", "data.synthetic.period_samples=1024",
        "--set", "train.progress=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if "ignored by replay" in x]
    assert len(lines) == 1 and " WARNING towerrec: train.steps and train.epochs" in lines[0]
    assert "warnings.warn" not in result.stderr and "UserWarning" not in result.stderr
