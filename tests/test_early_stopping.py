"""Early stopping, the best weights and the plateau LR schedule."""

import json

import pytest
import torch
from conftest import run_cli

from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.build.sources import build_source
from towerrec.cli import main
from towerrec.config import ConfigError, load_config
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.train.checkpoint import CheckpointManager, capture_rng
from towerrec.train.early_stopping import EarlyStopping
from towerrec.train.step import evaluate
from towerrec.workflows import training as trainer

# ------------------------------------------------------------------ pure logic


def test_logloss_stops_after_patience_evaluations_without_improvement():
    stopper = EarlyStopping(metric="logloss", patience=2, min_delta=0.01)
    assert stopper.update(10, {"logloss": 0.50})
    assert stopper.update(20, {"logloss": 0.48})
    assert not stopper.update(30, {"logloss": 0.475})  # better, but not by more than min_delta
    assert not stopper.stopped
    assert not stopper.update(40, {"logloss": 0.60})
    assert stopper.stopped and stopper.best_step == 20 and stopper.best_value == 0.48


def test_auc_is_higher_better_and_nan_never_improves():
    stopper = EarlyStopping(metric="auc", patience=3)
    assert stopper.update(1, {"auc": float("nan")}) is False
    assert stopper.update(2, {"auc": 0.6}) and not stopper.update(3, {"auc": 0.59})
    assert stopper.update(4, {"auc": 0.61}) and stopper.since_best == 0 and not stopper.stopped


def test_plateau_multiplies_the_lr_scale_down_to_the_floor_and_state_round_trips():
    stopper = EarlyStopping(plateau_factor=0.5, plateau_patience=2, min_lr_scale=0.2)
    losses = [0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
    scales = []
    for step, loss in enumerate(losses):
        stopper.update(step, {"logloss": loss})
        scales.append(stopper.lr_scale)
    assert scales == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2]
    assert not stopper.stopped  # patience 0: never stops
    again = EarlyStopping(plateau_factor=0.5, plateau_patience=2, min_lr_scale=0.2)
    again.load_state_dict(json.loads(json.dumps(stopper.state_dict())))
    assert again == stopper


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.early_stopping.metric=accuracy"], "train.early_stopping.metric = 'accuracy'"),
        (["train.early_stopping.patience=2", "train.eval_every=0"], "nothing could stop early"),
        (["optimizer.decay=plateau", "train.eval_every=0"], "validates only at the end"),
        (["train.eval_every=weekly"], 'number of steps or "epoch"'),
        (["train.eval_every=epoch"], "synthetic' is an endless stream"),
        (["optimizer.plateau_factor=1.5"], "plateau_factor must lie in"),
    ],
)
def test_bad_early_stopping_settings_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


# ------------------------------------------------------------------ training

SMALL = [
    "train.batch_size=128",
    "train.log_every=24",
    "train.progress=false",
    "train.eval_batch_size=4096",
    "optimizer.warmup_steps=2",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
]
# A learning rate 10x the default over 30 epochs of 3,000 rows: the validation loss is
# lowest after the first epoch and rises after it (overfitting), so the run must stop early.
OVERFIT = [
    *SMALL,
    "optimizer.lr=0.02",
    "train.epochs=30",
    "train.eval_every=epoch",
    "train.early_stopping.patience=2",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """3,000 rows in each of train (day_0), validation (day_1) and test (day_2)."""
    root = tmp_path_factory.mktemp("early-stopping")
    raw, out = root / "raw", root / "cache"
    assert main(["data", "gen-criteo", "--out", str(raw), "--files", "3", "--rows", "3000",
                 "--seed", "3"]) == 0  # fmt: skip
    assert main(["data", "criteo", *(str(raw / f"day_{i}") for i in range(3)), "--out", str(out),
                 "--validation-files", "day_1", "--test-files", "day_2", "--num-embeddings",
                 "500", "--no-progress"]) == 0  # fmt: skip
    return out


def _sets(cache, *extra):
    overrides = [*OVERFIT, "data.source=criteo", f"data.path={cache}", *extra]
    return [x for s in overrides for x in ("--set", s)]


def _records(run, kind):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _evaluate_checkpoint(run, step, split_batches):
    """Validation metrics of ``run``'s checkpoint at ``step`` in ``best/``, loaded afresh."""
    config = load_config(base=run / "config.toml")
    source = build_source(config.data)
    model = build_model(config, source.schema, torch.device("cpu"))
    optimizer = build_dense_optimizer(config.optimizer, model)
    placeholder = {"step": 0, "samples": 0, "train_s": 0.0, "rng": capture_rng()}
    CheckpointManager(run / "best").load(
        run / "best" / f"step_{step:08d}", model, optimizer, placeholder
    )
    return evaluate(model, split_batches(source), torch.device("cpu")).as_dict()


def test_early_stopping_stops_restores_the_best_weights_and_reports_them(cache, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *_sets(cache)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    budget = -(-30 * 3000 // 128)
    evals = _records(run, "eval")
    assert summary["stopped_early"] and summary["completed"]
    assert summary["steps"] < budget and summary["eval_every"] == -(-3000 // 128)
    assert [r["step"] for r in evals] == [24, 48, 72] and summary["steps"] == 72
    assert all(r["split"] == "validation" for r in evals)
    best = min(evals, key=lambda r: r["logloss"])
    assert summary["best_step"] == summary["weights_step"] == best["step"] == 24
    assert summary["best_validation"]["logloss"] == best["logloss"]
    # The returned weights are the best step's: the summary's metrics are theirs, and
    # evaluating the checkpoint in best/ afresh gives them again.
    assert [p.name for p in (run / "best").iterdir()] == ["step_00000024"]
    again = _evaluate_checkpoint(run, 24, lambda s: s.eval_batches(4096))
    for key in ("auc", "logloss", "ne", "calibration"):
        assert summary[key] == summary["best_validation"][key] == again[key]
    # The test split is scored once, with those weights.
    (test,) = _records(run, "test")
    assert test["step"] == 24 and test["split"] == "test" and test["eval_samples"] == 3000
    again = _evaluate_checkpoint(run, 24, lambda s: s.test_batches(4096))
    for key in ("auc", "logloss", "ne", "calibration", "eval_samples"):
        assert summary["test"][key] == test[key] == again[key]
    assert summary["test"]["logloss"] != summary["logloss"]  # another split
    # The run is over: a resume is refused with what to do instead.
    assert main(["train", "--out", str(run), "--resume"]) == 2


def test_resume_keeps_the_early_stopping_state_and_the_plateau_lr(cache, tmp_path):
    # Plateau: the LR halves after every validation without improvement, so the
    # scale differs before and after the stop, and resuming must carry it.
    extra = ["optimizer.decay=plateau", "optimizer.plateau_patience=1"]
    config = load_config(None, [*OVERFIT, "data.source=criteo", f"data.path={cache}", *extra])
    full = trainer.train(config, tmp_path / "full")
    assert full["stopped_early"] and full["lr_scale"] == 0.25
    for stop_after in (40, 48):  # between validations, and right after one that did not improve
        run = tmp_path / f"split{stop_after}"
        partial = trainer.train(config, run, stop_after=stop_after)
        assert not partial["completed"] and partial["lr_scale"] == 0.5 ** (stop_after >= 48)
        resumed = trainer.train(config, run, resume=True)
        for key in ("auc", "logloss", "steps", "best_step", "best_validation", "lr_scale"):
            assert resumed[key] == full[key], key
        for kind in ("eval", "test"):
            assert _records(run, kind) == _records(tmp_path / "full", kind)


def test_early_stopping_on_2_ranks_gives_the_same_best_step_and_metrics(cache, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", "--out", str(one), *_sets(cache)]) == 0
    result = run_cli("train", "--out", str(two), "--nproc", "2", *_sets(cache), OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = (json.loads((run / "summary.json").read_text()) for run in (one, two))
    assert b["stopped_early"] and (a["best_step"], a["steps"]) == (b["best_step"], b["steps"])
    for key in ("auc", "logloss"):
        assert abs(a[key] - b[key]) < 1e-6 and b[key] == b["best_validation"][key]
        assert abs(a["test"][key] - b["test"][key]) < 1e-6
    assert [p.name for p in (two / "best").iterdir()] == [f"step_{b['best_step']:08d}"]


def test_early_stopping_without_validation_rows_is_refused(tmp_path):
    days = generate_criteo_files(tmp_path / "raw", files=1, rows_per_file=500, seed=1)
    options = CriteoOptions(num_embeddings=(100,), eval_fraction=0.0)
    preprocess_criteo(days, tmp_path / "cache", options, progress=False)
    config = load_config(None, [*OVERFIT, "data.source=criteo", f"data.path={tmp_path / 'cache'}"])
    with pytest.raises(ValueError, match="no validation rows"):
        trainer.train(config, tmp_path / "run")
