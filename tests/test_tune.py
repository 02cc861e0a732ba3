"""towerrec tune: the space file, the report hook's pruning, a short study, its table,
plot and best config, resume after a kill, and a study file of another space or data."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, run_cli

from towerrec.config import load_config
from towerrec.train.checkpoint import CheckpointManager
from towerrec.train.metrics import EvalMetrics
from towerrec.workflows.tune.report_hook import TrialLink, TrialPruned, TrialReport
from towerrec.workflows.tune.space import Choice, Range, load_space, toml_value
from towerrec.workflows.tune.study import StudyRun, _check_database, run_study

optuna = pytest.importorskip("optuna")

QUICK = [
    "data.synthetic.num_embeddings=[60, 30, 90]",
    "data.synthetic.pooling_factors=[1, 2, 1]",
    "data.synthetic.eval_samples=1024",
    "train.batch_size=128",
    "train.steps=6",
    "train.eval_every=3",
    "train.progress=false",
    "optimizer.warmup_steps=1",
    "model.bottom_mlp=[16, 8]",
    "model.embedding_dim=8",
]

SPACE = """
[study]
metric = "auc"
trials = 3
startup_trials = 1

[space]
"optimizer.lr" = { low = 1e-4, high = 1e-2, log = true }
"model.top_mlp" = { choices = [[16, 1], [8, 8, 1]] }
[space.train]
batch_size = { low = 64, high = 256, step = 64 }
"""


def _space(tmp_path: Path, text: str = SPACE, name: str = "space.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def test_a_space_reads_ranges_choices_and_nested_tables(tmp_path):
    space = load_space(_space(tmp_path))
    by_key = {p.key: p for p in space.params}
    assert by_key["optimizer.lr"] == Range("optimizer.lr", 1e-4, 1e-2, log=True)
    assert by_key["model.top_mlp"] == Choice("model.top_mlp", ([16, 1], [8, 8, 1]))
    assert by_key["train.batch_size"].integer and by_key["train.batch_size"].step == 64
    assert not by_key["optimizer.lr"].integer
    assert space.study.trials == 3 and space.study.direction == "maximize"
    values = {"optimizer.lr": 0.001, "model.top_mlp": [8, 8, 1], "train.batch_size": 128}
    assert space.overrides(values) == [
        "optimizer.lr=0.001",
        "model.top_mlp=[8, 8, 1]",
        "train.batch_size=128",
    ]
    assert toml_value("uniform") == '"uniform"' and toml_value(True) == "true"


@pytest.mark.parametrize(
    "space, message",
    [
        ('"optimizer.lr" = { low = 0.1, high = 0.01 }', r"optimizer\.lr: the range .* is empty"),
        ('"optimizer.lr" = { low = 0.1, high = 0.1 }', r"optimizer\.lr: .* holds one value"),
        ('"optimizer.lr" = { low = 0.0, high = 0.1, log = true }', r"optimizer\.lr: a log range"),
        ('"optimizer.lr" = { low = -1.0, high = 1.0, log = true }', "positive low"),
        ('"model.dropout" = { choices = [] }', r"model\.dropout: choices must be a non-empty"),
        ('"model.dropout" = { low = 0.0 }', r"model\.dropout: a range is"),
        ('"model.dropout" = { low = 0.0, high = "a" }', r"model\.dropout: high must be"),
        ('"model.dropout" = 0.1', r"space\.model\.dropout = 0\.1: give a range"),
        ("", "has no parameters"),
    ],
)
def test_a_bad_space_is_refused_naming_the_key(tmp_path, space, message):
    with pytest.raises(ValueError, match=message):
        load_space(_space(tmp_path, f"[space]\n{space}\n"))


@pytest.mark.parametrize(
    "study, message",
    [
        ('metric = "ne"', "study.metric"),
        ('pruner = "hyperband"', "study.pruner"),
        ("trials = 0", "study.trials"),
        ("patience = 3", r"\[study\] takes"),
    ],
)
def test_bad_study_settings_are_refused(tmp_path, study, message):
    text = f'[study]\n{study}\n[space]\n"optimizer.lr" = {{ low = 0.001, high = 0.01 }}\n'
    with pytest.raises(ValueError, match=message):
        load_space(_space(tmp_path, text))


@pytest.mark.parametrize(
    "param, message",
    [
        ('"optimizer.rate" = { low = 0.001, high = 0.01 }', r"optimizer\.rate"),
        ('"embedding.init" = { choices = ["uniform", "zeros"] }', r"embedding\.init = 'zeros'"),
        ('"model.dropout" = { low = 0.0, high = 1.5 }', r"model\.dropout = 1\.5"),
    ],
)
def test_a_key_or_value_the_config_refuses_fails_before_any_trial(tmp_path, param, message):
    space = load_space(_space(tmp_path, f"[space]\n{param}\n"))
    out = tmp_path / "study"
    with pytest.raises(ValueError, match=message):
        run_study(StudyRun(None, tuple(QUICK), space, out), 1)
    assert not out.exists()


def test_a_base_config_the_config_refuses_is_named_as_the_base(tmp_path):
    space = load_space(_space(tmp_path))
    with pytest.raises(ValueError, match=r"the base config \(--config, --set\): .*bottom_mlp"):
        run_study(StudyRun(None, (*QUICK, "model.embedding_dim=4"), space, tmp_path / "s"))


def _session(tmp_path: Path) -> SimpleNamespace:
    ctx = SimpleNamespace(is_main=True, stop_agreed=lambda requested: requested)
    return SimpleNamespace(ctx=ctx, run=SimpleNamespace(metrics_path=tmp_path / "none.jsonl"))


def _metrics(auc: float) -> EvalMetrics:
    return EvalMetrics(auc=auc, logloss=0.5, ne=0.9, calibration=1.0, samples=100)


def test_the_hook_reports_each_validation_and_prunes_a_trial_that_falls_behind(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    study = optuna.create_study(
        storage=storage, study_name="towerrec", direction="maximize", pruner=pruner
    )
    for _ in range(2):  # two finished trials at 0.8, 0.9 after validations 1 and 2
        t = study.ask()
        t.report(0.8, 1)
        t.report(0.9, 2)
        study.tell(t, 0.9)
    trial = study.ask()
    link = TrialLink(storage, "towerrec", trial._trial_id, "auc", "median", 2, 1)
    hook = TrialReport(link)
    hook.setup(_session(tmp_path))  # type: ignore[arg-type]
    hook.on_start(0)
    hook.on_validation(10, _metrics(0.5))  # validation 1: within the warm-up, not pruned
    with pytest.raises(TrialPruned) as pruned:
        hook.on_validation(20, _metrics(0.6))  # validation 2: below the median 0.9
    assert pruned.value.validation == 2
    assert study.trials[2].intermediate_values == {1: 0.5, 2: 0.6}


def _read_trials(out: Path) -> list[dict[str, str]]:
    with (out / "trials.csv").open() as f:
        return list(csv.DictReader(f))


def test_a_short_study_writes_runs_a_table_a_plot_and_the_best_config(tmp_path):
    space, out = _space(tmp_path), tmp_path / "study"
    result = run_cli("tune", "--space", str(space), "--out", str(out), *_sets(QUICK))
    assert result.returncode == 0, result.stderr
    rows = _read_trials(out)
    assert [r["trial"] for r in rows] == ["0", "1", "2"]
    assert (out / "trials.png").stat().st_size > 0
    for r in rows:
        assert r["state"] in ("complete", "pruned"), r
        assert (out / f"trial-{int(r['trial']):03d}" / "config.toml").is_file()
    complete = [r for r in rows if r["state"] == "complete"]
    best = max(complete, key=lambda r: float(r["value"]))
    summary = json.loads((Path(best["run"]) / "summary.json").read_text())
    assert float(best["value"]) == pytest.approx(summary["auc"])  # validation, not test
    assert f"best: trial {best['trial']}," in result.stdout
    # best.toml is a config `towerrec train --config` takes: the base with the best values
    config = load_config(out / "best.toml")
    assert config.optimizer.lr == pytest.approx(float(best["optimizer.lr"]))
    assert config.train.batch_size == int(best["train.batch_size"])
    assert list(config.model.top_mlp) == json.loads(best["model.top_mlp"])
    assert config.train.steps == 6 and tuple(config.data.synthetic.num_embeddings) == (60, 30, 90)

    # the same command continues the study: one more trial, none repeated
    more = run_cli("tune", "--space", str(space), "--out", str(out), "--trials", "4", *_sets(QUICK))
    assert more.returncode == 0, more.stderr
    assert [r["trial"] for r in _read_trials(out)] == ["0", "1", "2", "3"]
    assert _read_trials(out)[:3] == rows

    # a study file of another space, or of another data set, is refused naming the change
    other = load_space(_space(tmp_path, SPACE.replace("1e-2", "1e-1"), "other.toml"))
    with pytest.raises(ValueError, match=r"another space \(it differs in \['optimizer\.lr'\]"):
        run_study(StudyRun(None, tuple(QUICK), other, out))
    data = (*QUICK, "data.synthetic.num_embeddings=[60, 30, 91]")
    with pytest.raises(ValueError, match=r"another data set \(data\.synthetic\.num_embeddings"):
        run_study(StudyRun(None, data, load_space(space), out))
    metric = load_space(_space(tmp_path, SPACE.replace('"auc"', '"logloss"'), "logloss.toml"))
    with pytest.raises(ValueError, match="a study of validation auc, not logloss"):
        run_study(StudyRun(None, tuple(QUICK), metric, out))
    # how a run looks may change (no progress bar), what it learns may not
    with pytest.raises(ValueError, match=r"another base config \(optimizer\.warmup_steps"):
        run_study(StudyRun(None, (*QUICK, "optimizer.warmup_steps=2"), load_space(space), out))
    assert (
        len(
            run_study(
                StudyRun(None, (*QUICK, "train.log_every=7"), load_space(space), out), 4
            ).trials
        )
        == 4
    )


def test_the_study_url_names_the_file_at_any_path(tmp_path):
    out = tmp_path / "runs?lr=1e-3 #2 100%"  # a query, a fragment and an escape in a URL
    out.mkdir()
    run = StudyRun(None, tuple(QUICK), load_space(_space(tmp_path)), out)
    study = optuna.create_study(storage=run.storage, study_name="towerrec")
    study.add_trial(optuna.trial.create_trial(value=1.0))
    assert [p.name for p in out.iterdir()] == ["study.db"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("runs") and p != out]
    _check_database(out / "study.db")
    assert len(optuna.load_study(study_name="towerrec", storage=run.storage).trials) == 1


@pytest.mark.parametrize("damage", ["cut", "overwritten"])
def test_a_damaged_study_file_is_refused_naming_it(tmp_path, damage):
    out = tmp_path / "study #1"  # a character a file URI must escape
    out.mkdir()
    db = out / "study.db"
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="towerrec")
    for value in range(20):
        study.add_trial(optuna.trial.create_trial(value=float(value)))
    _check_database(db)  # whole, at a path with characters a file URI must escape
    size = db.stat().st_size
    if damage == "cut":
        os.truncate(db, size // 2)
        match = r"study\.db is (damaged|not a readable study database)"
    else:
        with db.open("r+b") as f:
            f.write(b"\0" * 100)  # SQLite's header
        match = r"study\.db is not a readable study database"
    with pytest.raises(ValueError, match=match + ".* move it away to start a new study"):
        run_study(StudyRun(None, tuple(QUICK), load_space(_space(tmp_path)), out))


def _trial_states(out: Path) -> dict[int, str]:
    study = optuna.load_study(study_name="towerrec", storage=f"sqlite:///{out / 'study.db'}")
    return {t.number: t.state.name for t in study.trials}


@pytest.mark.slow
def test_a_study_killed_mid_trial_resumes_without_losing_or_repeating_trials(tmp_path):
    space = _space(tmp_path, SPACE.replace("startup_trials = 1", 'pruner = "none"'))
    out = tmp_path / "study"
    slow = [*QUICK, "train.steps=120", "train.eval_every=40", "train.checkpoint_every=20"]
    cmd = [sys.executable, "-m", "towerrec.cli", "tune", "--space", str(space), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [*cmd, *_sets(slow)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 240
        checkpoints = CheckpointManager(out / "trial-001" / "checkpoint")
        while checkpoints.latest() is None:  # until trial 1 has saved a whole checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, "trial 1 never saved"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    states = _trial_states(out)
    assert states == {0: "COMPLETE", 1: "RUNNING"}
    before = optuna.load_study(study_name="towerrec", storage=f"sqlite:///{out / 'study.db'}")
    params = before.trials[1].params

    result = run_cli("tune", "--space", str(space), "--out", str(out), *_sets(slow))
    assert result.returncode == 0, result.stderr
    after = optuna.load_study(study_name="towerrec", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.number for t in after.trials] == [0, 1, 2]
    assert all(t.state.name == "COMPLETE" for t in after.trials)
    assert after.trials[1].params == params  # trial 1 continued with its own values
    records = [json.loads(line) for line in (out / "trial-001" / "metrics.jsonl").open()]
    assert any(r.get("kind") == "resume" for r in records)  # from its checkpoint


@pytest.mark.multiprocess
def test_nproc_2_trains_each_trial_on_two_workers_that_report_to_the_study(tmp_path):
    text = "[study]\ntrials = 2\nstartup_trials = 1\nwarmup_validations = 0\n[space]\n"
    text += '"optimizer.lr" = { choices = [0.01, 1e-7] }\n'  # the second trial cannot learn
    space, out = _space(tmp_path, text), tmp_path / "study"
    sets = [*QUICK, "train.eval_batch_size=512"]
    result = run_cli("tune", "--space", str(space), "--out", str(out), "--nproc", "2", *_sets(sets))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _read_trials(out)
    assert len(rows) == 2 and rows[0]["state"] == "complete"
    summary = json.loads((out / "trial-000" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert int(rows[0]["validations"]) == 2  # steps 3 and 6, reported by rank 0 alone


def test_a_failing_trial_is_recorded_with_its_error_and_the_study_goes_on(tmp_path, one_thread):
    text = '[study]\ntrials = 2\n[space]\n"data.path" = { choices = ["nope-1", "nope-2"] }\n'
    space = load_space(_space(tmp_path, text))
    study = run_study(StudyRun(None, (*QUICK, 'data.source="cache"'), space, tmp_path / "study"))
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    assert "nope-" in study.trials[0].user_attrs["error"]
