"""Preprocess then train, through the library and the real command line."""

import json
import random
import shlex

import pytest
from conftest import run_cli

from towerrec.cli import main
from towerrec.config import load_config
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.train.summary import warn_worse_than_base_rate
from towerrec.workflows import training as trainer


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
    assert "6,000 train, 6,000 validation and 0 test rows" in result.stdout
    assert main(["data", "info", str(cache)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["rows"] == {"train": 6000, "validation": 6000, "test": 0} and info["checksums"] == "ok"
    )
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


def towerrec_in(cwd, *args):
    """``towerrec ARGS...`` run from ``cwd`` (relative paths as a user types them)."""
    return run_cli(*args, cwd=cwd, OMP_NUM_THREADS="1")


def printed_train_command(stdout):
    """The arguments after ``towerrec`` of the converter's ``train with:`` line."""
    lines = [x for x in stdout.splitlines() if x.startswith("train with: ")]
    assert len(lines) == 1, stdout
    command = shlex.split(lines[0].removeprefix("train with: "))
    assert command[:2] == ["towerrec", "train"], command
    return command[1:]


# Only shrinks the run; the printed command chooses the data.
QUICK_RUN = ["--set", "train.steps=4", *(x for s in SMALL for x in ("--set", s))]


def test_criteo_without_split_options_holds_out_eval_rows_and_its_command_trains(tmp_path):
    result = towerrec_in(
        tmp_path, "data", "gen-criteo", "--out", "raw", "--files", "1", "--rows", "100000"
    )
    assert result.returncode == 0, result.stderr
    result = towerrec_in(
        tmp_path, "data", "criteo", "raw/day_0", "--out", "my cache", "--num-embeddings", "1000",
        "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "no split option given: holding out a seeded 10% of the rows" in result.stdout
    rows = json.loads(towerrec_in(tmp_path, "data", "info", "my cache").stdout)["rows"]
    assert 9000 < rows["validation"] < 11000 and rows["train"] + rows["validation"] == 100_000
    # The printed command, as printed: the default run on small real data trains until
    # validation stops improving (at most 20 epochs), validating every epoch.
    result = towerrec_in(tmp_path, *printed_train_command(result.stdout))
    assert result.returncode == 0, result.stderr[-3000:]
    batch = load_config("criteo", [f"data.path={tmp_path / 'my cache'}"]).train.batch_size
    epoch, cap = -(-rows["train"] // batch), -(-20 * rows["train"] // batch)
    assert f"train.steps = {cap:,}: 20 epoch(s) of {rows['train']:,} training rows" in result.stderr
    assert "up to 20 epochs, until validation stops improving" in result.stderr
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_every"] == epoch and summary["eval_samples"] == rows["validation"]
    assert summary["best_step"] % epoch == 0 or summary["best_step"] == cap
    assert summary["weights_step"] == summary["best_step"]  # the best weights are kept
    assert summary["ne"] < 1  # better than predicting the click rate
    assert "normalized entropy" not in result.stderr


def test_tables_larger_than_memory_are_refused_and_the_printed_kv_command_trains(tmp_path):
    """Tables of 2^31 - 1 rows cannot be held whole on any machine this runs on: the
    converter prints the cached kv command instead, plain training refuses with the
    fixes before allocating, and the printed command trains."""
    result = towerrec_in(tmp_path, "data", "gen-criteo", "--out", "raw", "--rows", "1500")
    assert result.returncode == 0, result.stderr
    result = towerrec_in(
        tmp_path, "data", "criteo", "raw/day_0", "--out", "wide",
        "--num-embeddings", "2147483647", "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "held whole at embedding dim 16, more than this machine's" in result.stdout
    command = printed_train_command(result.stdout)
    assert "embedding.backing=kv" in command and "embedding.backing_path=wide-kv" in command
    plain = command[: command.index("embedding.memory=cached") - 1]
    refused = towerrec_in(tmp_path, *plain, *QUICK_RUN)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    # The printed criteo recipe's Adam at QUICK_RUN's dim 8: 26 tables x (2^31 - 1) rows x
    # 24 floats (the row and its two moments)
    assert command[:3] == ["train", "--config", "criteo"], command
    assert "the 26 embedding tables need 4,992.0 GiB" in refused.stderr
    assert "--set embedding.memory=cached" in refused.stderr
    result = towerrec_in(tmp_path, *command, "--out", "run", *QUICK_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4
    assert (tmp_path / "wide-kv").is_dir()


def test_a_final_normalized_entropy_above_1_is_warned_about(criteo_cache, tmp_path, caplog):
    # One step from the initial weights (predictions near 0.5) at a click rate near 0.25.
    config = load_config(
        None,
        [*SMALL, "data.source=criteo", f"data.path={criteo_cache}", "train.steps=1",
         "optimizer.warmup_steps=100"],
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="towerrec"):
        summary = trainer.train(config, tmp_path / "run")
    assert summary["ne"] >= 1
    warned = [r.getMessage() for r in caplog.records if "normalized entropy" in r.getMessage()]
    assert len(warned) == 1 and "learning rate" in warned[0] and "too short" in warned[0]
    assert "overfitting" not in warned[0]  # one batch of a fraction of an epoch


@pytest.mark.parametrize(
    ("samples", "named"),
    [(2048, False), (2 * 2048, True)],  # one epoch of 1,500 rows rounded up to a batch; two
)
def test_too_many_passes_is_named_only_beyond_one_rounded_epoch(samples, named, caplog):
    with caplog.at_level("WARNING", logger="towerrec"):
        warn_worse_than_base_rate(1.1, samples, train_rows=1500, batch_size=2048)
    (message,) = [r.getMessage() for r in caplog.records]
    assert ("too many passes" in message) is named and "learning rate too high" in message


LIBFM_FIELDS = "user 0 49\nitem 50 149\nctx 150 159 multi\n"


def test_libfm_without_split_options_trains_and_no_eval_rows_names_real_options(tmp_path):
    rng = random.Random(0)
    lines = [
        f"{rng.randint(0, 1)} {rng.randrange(50)}:1 {rng.randrange(50, 150)}:1 "
        f"{rng.randrange(150, 160)}:1"
        for _ in range(2000)
    ]
    (tmp_path / "train.libfm").write_text("\n".join(lines) + "\n")
    (tmp_path / "fields.txt").write_text(LIBFM_FIELDS)
    convert = ["data", "libfm", "train.libfm", "--fields", "fields.txt"]
    result = towerrec_in(tmp_path, *convert, "--out", "cache")
    assert result.returncode == 0, result.stderr
    assert "holding out a seeded 10% of the rows" in result.stdout
    command = printed_train_command(result.stdout)
    assert command[-2:] == ["--set", "model.bottom_mlp=[]"]  # libFM: no dense features
    small = [x for s in SMALL if not s.startswith("model.bottom_mlp") for x in ("--set", s)]
    result = towerrec_in(tmp_path, *command, "--out", "run", "--set", "train.steps=4", *small)
    assert result.returncode == 0, result.stderr[-3000:]

    # Asked for no validation rows (by the option's earlier name): no train command is
    # printed, and training names real options.
    result = towerrec_in(tmp_path, *convert, "--out", "no-eval", "--eval-fraction", "0")
    assert result.returncode == 0, result.stderr
    assert "train with:" not in result.stdout
    assert "no validation rows" in result.stdout and "--validation-fraction F" in result.stdout
    train = ["train", "--set", "data.source=cache", "--set", "data.path=no-eval", *QUICK_RUN]
    result = towerrec_in(tmp_path, *train, "--out", "run2")
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert "no validation rows" in error and "towerrec data libfm" in error, error
    assert "--validation-fraction F" in error and "data criteo" not in error, error
