import dataclasses
import json
import tomllib

import pytest
import torch
from conftest import run_cli

from towerrec.config import ConfigError, config_from_dict, config_to_toml, load_config
from towerrec.data.batch import Batch
from towerrec.data.synthetic import SyntheticSource
from towerrec.modules.kernels.base import Backend
from towerrec.train import loop, session
from towerrec.train.checkpoint import embedding_optimizer_state_dict
from towerrec.train.run_dir import RunDir, RunFileError
from towerrec.workflows import training as trainer

QUICK = [
    "data.synthetic.num_embeddings=[60, 30, 90]",
    "data.synthetic.pooling_factors=[1, 2, 1]",
    "data.synthetic.eval_samples=4096",
    "train.batch_size=256",
    "train.eval_every=0",
    "train.log_every=5",
    "train.progress=false",
    "optimizer.warmup_steps=4",
]


def quick_config(*extra):
    return load_config(None, [*QUICK, *extra])


def final_state(out_dir, config):
    """Weights and optimizer state of the run's last checkpoint, loaded into a fresh model."""
    from towerrec.build.models import build_model
    from towerrec.build.optimizers import build_dense_optimizer
    from towerrec.train.checkpoint import CheckpointManager

    source = SyntheticSource(config.data.synthetic)
    model = build_model(config, source.schema, torch.device("cpu"))
    optimizer = build_dense_optimizer(config.optimizer, model)
    manager = CheckpointManager(out_dir / "checkpoint")
    manager.load(
        manager.latest(), model, optimizer, {"step": 0, "samples": 0, "train_s": 0.0, "rng": {}}
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update(
        {f"emb_opt/{k}": v.clone() for k, v in embedding_optimizer_state_dict(model).items()}
    )
    for i, s in enumerate(optimizer.state_dict()["state"].values()):
        state.update({f"opt/{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return state


SHAMPOO = [
    "optimizer.name=shampoo",  # inverse roots at steps 3, 7, 11, ...: the resume at 9 uses saved ones
    "optimizer.shampoo.start_preconditioning_step=3",
    "optimizer.shampoo.precondition_frequency=4",
]


@pytest.mark.parametrize(
    "settings",
    [
        ["embedding.backend=torch"],
        ["embedding.backend=auto"],
        ["embedding.backend=torch", *SHAMPOO],
    ],
    ids=["torch", "auto", "shampoo"],
)
def test_resume_equals_uninterrupted(tmp_path, settings):
    config = quick_config("train.steps=20", *settings)
    full = trainer.train(config, tmp_path / "full")
    stopped = trainer.train(config, tmp_path / "split", stop_after=8)
    assert stopped["steps"] == 8 and not stopped["completed"]
    resumed = trainer.train(config, tmp_path / "split", resume=True)
    assert resumed["completed"] and resumed["steps"] == 20
    a, b = final_state(tmp_path / "full", config), final_state(tmp_path / "split", config)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["auc"] == full["auc"]
    records = [
        json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if r["kind"] == "train"] == [5, 10, 15, 20]
    full_losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert [r["loss"] for r in records if r["kind"] == "train"][2:] == full_losses[2:]


def test_resume_through_the_cli_keeps_the_run_config(tmp_path):
    """`towerrec train --resume` continues with the run's saved overrides (not the
    defaults), refuses a conflicting --set, extends with train.steps, and never rewrites
    config.toml."""
    config = quick_config("train.steps=12", "embedding.lr=0.2", "optimizer.lr=0.005")
    trainer.train(config, tmp_path / "full")
    split = tmp_path / "split"
    trainer.train(config, split, stop_after=6)
    saved = (split / "config.toml").read_text()

    refused = run_cli("train", "--out", str(split), "--resume", "--set", "embedding.lr=0.5")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "cannot change embedding.lr = 0.5 (the run has 0.2)" in refused.stderr
    resumed = run_cli("train", "--out", str(split), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = final_state(tmp_path / "full", config), final_state(split, config)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

    extended = run_cli("train", "--out", str(split), "--resume", "--set", "train.steps=15")
    assert extended.returncode == 0, extended.stderr[-2000:]
    assert json.loads((split / "summary.json").read_text())["steps"] == 15
    assert (split / "config.toml").read_text() == saved
    records = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r["kind"] == "resume"] == [
        {"kind": "resume", "step": 6, "changed": {}},
        {"kind": "resume", "step": 12, "changed": {"train.steps": {"from": 12, "to": 15}}},
    ]


def test_run_directory_contents(tmp_path):
    config = quick_config("train.steps=10", "train.eval_every=5")
    summary = trainer.train(config, tmp_path)
    for name in ("config.toml", "metrics.jsonl", "summary.json", "curves.png"):
        assert (tmp_path / name).is_file(), name
    recorded = config_from_dict(tomllib.loads((tmp_path / "config.toml").read_text()))
    # config.toml holds the run's config with its `auto` kernel and precision resolved (a
    # resume keeps them)
    assert recorded.embedding.backend is not Backend.AUTO
    assert recorded.train.precision in ("fp32", "bf16")
    chosen = dataclasses.replace(config.embedding, backend=recorded.embedding.backend)
    precision = dataclasses.replace(config.train, precision=recorded.train.precision)
    assert recorded == dataclasses.replace(config, embedding=chosen, train=precision)
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "auc",
        "logloss",
        "ne",
        "calibration",
        "oracle_auc",
        "samples_per_s",
        "steps",
        "num_params",
    ):
        assert saved[key] is not None, key
    assert saved == json.loads(json.dumps(summary))
    evals = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ]
    assert [e["step"] for e in evals] == [5, 10]
    assert (tmp_path / "checkpoint").is_dir()
    with pytest.raises(FileExistsError, match="already holds a run; pass --resume"):
        trainer.train(config, tmp_path)


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        trainer.train(quick_config("train.steps=2"), tmp_path, resume=True)


def test_resume_with_other_model_is_an_error(tmp_path):
    trainer.train(quick_config("train.steps=2"), tmp_path)
    other = quick_config("train.steps=4", "model.top_mlp=[16, 1]")
    with pytest.raises(ConfigError, match=r"cannot change model.top_mlp = \[16, 1\]"):
        trainer.train(other, tmp_path, resume=True)
    (tmp_path / "config.toml").write_text(config_to_toml(other))  # edited by hand
    with pytest.raises(RunFileError, match=r"config\.toml changed since the run wrote it"):
        trainer.train(other, tmp_path, resume=True)
    (tmp_path / "checksums.json").unlink()  # as in a run of a towerrec before checksums
    with pytest.raises(ValueError, match="does not fit this model"):
        trainer.train(other, tmp_path, resume=True)


def test_a_changed_digit_in_the_runs_files_is_refused(tmp_path):
    """config.toml and summary.json are recorded in the run's checksums.json as they are
    written: a resume refuses a config.toml whose learning rate changed by one digit
    (still valid TOML, and a setting a resume may not change), and the summary that
    names the returned weights is refused once changed; restored, both are taken."""
    run = RunDir(tmp_path)
    trainer.train(quick_config("train.steps=4", "optimizer.lr=0.002"), tmp_path)
    config_text, summary_text = run.config_path.read_text(), (tmp_path / "summary.json").read_text()
    assert "lr = 0.002" in config_text
    run.config_path.write_text(config_text.replace("lr = 0.002", "lr = 0.003", 1))
    with pytest.raises(RunFileError, match=r"config\.toml changed.*--set.*--config"):
        trainer.train(quick_config("train.steps=6"), tmp_path, resume=True)
    run.config_path.write_text(config_text)
    assert run.read_summary()["steps"] == 4
    (tmp_path / "summary.json").write_text(summary_text.replace('"steps": 4', '"steps": 3'))
    with pytest.raises(RunFileError, match=r"summary\.json changed.*--resume"):
        run.read_summary()
    (tmp_path / "summary.json").write_text(summary_text)
    trainer.train(quick_config("train.steps=6"), tmp_path, resume=True)
    assert run.read_summary()["steps"] == 6  # the resume's summary, recorded in its turn


def test_metrics_jsonl_drops_a_torn_last_line_and_refuses_a_damaged_one(tmp_path):
    run = RunDir(tmp_path)
    run.start(quick_config(), resume=False)
    for step in (5, 10):
        run.log({"kind": "train", "step": step, "loss": 0.5})
    whole = run.metrics_path.read_text()
    run.metrics_path.write_text(whole + '{"kind": "train", "st')  # a crash mid-write
    assert [r["step"] for r in run.records()] == [5, 10]
    run.metrics_path.write_text(whole.replace('"step": 5', '"step": 5,,'))
    with pytest.raises(RunFileError, match=r"metrics\.jsonl:1 is not a record"):
        run.records()


def test_nan_dense_feature_stops_training_with_a_clear_error(tmp_path, monkeypatch):
    class Poisoned(SyntheticSource):
        def train_batches(self, batch_size, start_batch=0, rank=0, world_size=1):
            for i, batch in enumerate(
                super().train_batches(batch_size, start_batch, rank, world_size)
            ):
                if i == 2:
                    batch.dense[7, 3] = float("nan")
                yield batch

    monkeypatch.setattr(session, "build_source", lambda cfg: Poisoned(cfg.synthetic))
    with pytest.raises(ValueError, match=r"dense feature 3 of sample 7 is nan"):
        trainer.train(quick_config("train.steps=5"), tmp_path)


def test_a_negative_synthetic_id_stops_training_with_a_clear_error(tmp_path, monkeypatch):
    class Poisoned(SyntheticSource):  # its batches skip the KeyedJaggedTensor checks
        def train_batches(self, batch_size, start_batch=0, rank=0, world_size=1):
            for i, batch in enumerate(
                super().train_batches(batch_size, start_batch, rank, world_size)
            ):
                if i == 2:
                    batch.sparse.values()[0] = -3
                yield batch

    monkeypatch.setattr(session, "build_source", lambda cfg: Poisoned(cfg.synthetic))
    with pytest.raises(ValueError, match=r"id -3 of feature 'cat_0' \(sample 0\) is out of"):
        trainer.train(quick_config("train.steps=5", "embedding.backend=auto"), tmp_path)


def test_batch_validation_errors():
    jag = SyntheticSource(load_config(None, QUICK).data.synthetic).samples("train", 0, 4)[0].sparse
    with pytest.raises(ValueError, match="dense feature 1 of sample 2 is inf"):
        dense = torch.zeros(4, 3)
        dense[2, 1] = float("inf")
        Batch(dense, jag, torch.zeros(4))
    with pytest.raises(ValueError, match=r"label of sample 1 is 3\.0"):
        Batch(torch.zeros(4, 3), jag, torch.tensor([0.0, 3.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="dense has 3 rows but there are 4 labels"):
        Batch(torch.zeros(3, 3), jag, torch.zeros(4))


def test_lr_schedule():
    from towerrec.train.step import lr_factor

    cfg = load_config(
        None, ["optimizer.warmup_steps=10", "optimizer.decay=linear", "optimizer.min_lr_ratio=0.0"]
    ).optimizer
    assert lr_factor(cfg, 5, 110) == pytest.approx(0.5)
    assert lr_factor(cfg, 10, 110) == pytest.approx(1.0)
    assert lr_factor(cfg, 60, 110) == pytest.approx(0.5)
    assert lr_factor(cfg, 110, 110) == pytest.approx(0.0)
    cos = load_config(None, ["optimizer.warmup_steps=0", "optimizer.min_lr_ratio=0.2"]).optimizer
    assert lr_factor(cos, 50, 100) == pytest.approx(0.6)


def test_resume_of_a_finished_run_says_how_to_continue(tmp_path):
    trainer.train(quick_config("train.steps=3"), tmp_path)
    with pytest.raises(
        ValueError, match=r"already finished step 3 of train.steps = 3; raise train.steps"
    ):
        trainer.train(quick_config("train.steps=3"), tmp_path, resume=True)
    summary = trainer.train(quick_config("train.steps=5"), tmp_path, resume=True)
    assert summary["steps"] == 5


class _Rows:
    """A source with ``train_rows`` training rows (all ``resolve_steps`` reads)."""

    def __init__(self, train_rows):
        self.train_rows = train_rows


def test_steps_are_resolved_from_the_source_unless_set():
    from towerrec.build.resolve import CONVERGE_MAX_ROWS, resolve_steps

    real = ["data.source=criteo", "data.path=cache", "train.batch_size=1000"]
    assert resolve_steps(load_config(), None)[0] == 2500  # synthetic: the fixed default
    explicit = load_config(None, ["train.steps=7"])
    assert resolve_steps(explicit, None) == (7, "as train.steps sets it")
    # Small real data: a cap of 20 epochs, which early stopping ends.
    steps, why = resolve_steps(load_config(None, real), _Rows(10_001))
    assert steps == 201 and "up to 20 epochs, until validation stops improving" in why
    # Beyond CONVERGE_MAX_ROWS training rows: one pass, rounded up to whole steps.
    steps, why = resolve_steps(load_config(None, real), _Rows(CONVERGE_MAX_ROWS + 1))
    assert steps == CONVERGE_MAX_ROWS // 1000 + 1 and "one pass" in why
    assert resolve_steps(load_config(None, [*real, "train.epochs=0.1"]), _Rows(10_000))[0] == 1
    assert resolve_steps(load_config(None, [*real, "train.epochs=2.5"]), _Rows(10_000))[0] == 25
    assert resolve_steps(load_config(None, [*real, "train.steps=3"]), _Rows(10_000))[0] == 3


def test_a_run_sized_from_its_data_scales_the_default_warm_up():
    """A run sized from its data that is shorter than ten times the default 100-step
    warm-up gets a tenth of its steps instead, unless steps or warm-up were chosen."""
    from towerrec.build.resolve import resolve_run_config

    real = ["data.source=criteo", "data.path=cache", "train.batch_size=1000"]
    config, why = resolve_run_config(load_config(None, [*real, "train.epochs=1"]), _Rows(15_000))
    assert (config.train.steps, config.optimizer.warmup_steps) == (15, 1)
    assert "optimizer.warmup_steps 100 -> 1" in why
    config, _ = resolve_run_config(load_config(None, real), _Rows(15_000))  # 20 epochs at most
    assert (config.train.steps, config.optimizer.warmup_steps) == (300, 30)
    config, _ = resolve_run_config(load_config(None, real), _Rows(30_000_000))  # one pass
    assert (config.train.steps, config.optimizer.warmup_steps) == (30_000, 100)
    chosen = [*real, "optimizer.warmup_steps=50"]
    assert (
        resolve_run_config(load_config(None, chosen), _Rows(15_000))[0].optimizer.warmup_steps == 50
    )
    explicit = [*real, "train.steps=15"]
    assert (
        resolve_run_config(load_config(None, explicit), _Rows(15_000))[0].optimizer.warmup_steps
        == 100
    )
    synthetic = resolve_run_config(load_config(), None)[0]
    assert (synthetic.train.steps, synthetic.optimizer.warmup_steps) == (2500, 100)


def test_small_real_data_trains_to_convergence_by_default_and_records_it():
    """Neither train.steps nor train.epochs on real data of at most CONVERGE_MAX_ROWS
    rows: validations every epoch and early stopping, written into the resolved config
    (what the run saves as config.toml, so a resume keeps them); what the config chose
    itself stays."""
    from towerrec.build.resolve import resolve_run_config

    real = ["data.source=criteo", "data.path=cache", "train.batch_size=1000"]
    config, why = resolve_run_config(load_config(None, real), _Rows(15_000))
    assert config.train.eval_every == "epoch" and config.train.early_stopping.patience == 2
    assert config.train.epochs is None and config.train.steps == 300
    assert 'train.eval_every = "epoch"; train.early_stopping.patience = 2' in why
    again, _ = resolve_run_config(config, _Rows(15_000))  # a resume's saved config
    assert again == config
    chosen = [*real, "train.eval_every=7", "train.early_stopping.patience=5"]
    config, why = resolve_run_config(load_config(None, chosen), _Rows(15_000))
    assert (config.train.eval_every, config.train.early_stopping.patience) == (7, 5)
    assert "train.eval_every =" not in why
    for other in (["train.epochs=3"], ["train.steps=30"]):
        config, _ = resolve_run_config(load_config(None, [*real, *other]), _Rows(15_000))
        assert (config.train.eval_every, config.train.early_stopping.patience) == (500, 0)
    large, _ = resolve_run_config(load_config(None, real), _Rows(30_000_000))
    assert (large.train.eval_every, large.train.early_stopping.patience) == (500, 0)
    at_end, _ = resolve_run_config(load_config(None, [*real, "train.eval_every=0"]), _Rows(15_000))
    assert (at_end.train.eval_every, at_end.train.early_stopping.patience) == (0, 0)
    grown, _ = resolve_run_config(
        load_config(
            None,
            [
                *real,
                'train.prune_grow.mlps=["top"]',
                "train.prune_grow.prune_at=[0.1]",
                "train.prune_grow.grow_at=[0.5]",
            ],
        ),
        _Rows(15_000),
    )
    assert grown.train.early_stopping.patience == 0  # a grown run must end full-size


def test_tensorboard_event_files_carry_the_metrics_records(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = quick_config("train.steps=10", "train.eval_every=5", "train.tensorboard=true")
    trainer.train(config, tmp_path / "run")
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    for kind, key in (("train", "loss"), ("eval", "auc"), ("eval", "logloss")):
        logged = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        written = [(e.step, e.value) for e in events.Scalars(f"{kind}/{key}")]
        assert [s for s, _ in written] == [s for s, _ in logged] and logged, (kind, key)
        assert [v for _, v in written] == pytest.approx([v for _, v in logged], rel=1e-6)


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install 'towerrec\[tensorboard\]'"):
        trainer.train(quick_config("train.steps=2", "train.tensorboard=true"), tmp_path / "run")


def test_a_model_that_predicts_one_value_for_every_example_is_warned_about(
    tmp_path, monkeypatch, caplog
):
    real = loop.evaluate

    def dead(model, *args, **kwargs):  # the model's output no longer depends on its input
        last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
        with torch.no_grad():
            last.weight.zero_()
        return real(model, *args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", dead)
    with caplog.at_level("WARNING", logger="towerrec"):
        trainer.train(quick_config("train.steps=4", "train.eval_every=2"), tmp_path / "dead")
    warned = [r.getMessage() for r in caplog.records if "same prediction" in r.getMessage()]
    assert len(warned) == 1 and "step 2:" in warned[0], warned  # once, at the first evaluation
    monkeypatch.setattr(loop, "evaluate", real)
    caplog.clear()
    with caplog.at_level("WARNING", logger="towerrec"):
        trainer.train(quick_config("train.steps=4", "train.eval_every=2"), tmp_path / "alive")
    assert not [r for r in caplog.records if "same prediction" in r.getMessage()]
