"""``towerrec replay``: one pass through the periods in order, each scored before it is trained on."""

import json
import logging

import pytest
import torch

from towerrec.cli.app import main
from towerrec.config import load_config
from towerrec.data.synthetic import SyntheticSource
from towerrec.train.step import evaluate
from towerrec.workflows import training as trainer
from towerrec.workflows.replay.replay import run_replay

SMALL = [
    "data.synthetic.num_embeddings=[40, 60, 90]",
    "data.synthetic.pooling_factors=[1, 1, 2]",
    "data.synthetic.num_dense=4",
    "data.synthetic.eval_samples=3000",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "train.batch_size=256",
    "train.progress=false",
    "optimizer.warmup_steps=2",
]
PERIODS = ["data.synthetic.periods=3", "data.synthetic.period_samples=512"]


def test_stationary_replay_ends_with_the_weights_of_plain_training(tmp_path):
    """Drift 0, turnover 0: the periods are the plain stream's first 3 * 512 samples, so
    replay's 6 steps end where `towerrec train` with train.steps = 6 ends."""
    config = load_config(None, SMALL + PERIODS)
    model, summary = run_replay(config, progress=False)
    assert summary["steps"] == 6 and len(summary["results"]) == 2
    assert [r["period"] for r in summary["results"]] == [1, 2]

    plain = trainer.train(
        load_config(None, [*SMALL, "train.steps=6", "train.eval_every=0"]), tmp_path / "plain"
    )
    source = SyntheticSource(config.data.synthetic)
    metrics = evaluate(
        model, source.eval_batches(config.train.eval_batch_size), torch.device("cpu")
    )
    assert metrics.auc == plain["auc"]
    assert metrics.logloss == plain["logloss"]


def test_drifting_replay_through_the_cli(tmp_path, capsys, caplog):
    out = tmp_path / "replay"
    drift = ["data.synthetic.drift=0.3", "data.synthetic.id_turnover=0.1"]
    args = ["replay", "--out", str(out)]
    for item in SMALL + PERIODS + drift:
        args += ["--set", item]
    with caplog.at_level(logging.INFO, logger="towerrec"):
        assert main(args) == 0
    printed = capsys.readouterr()
    assert "mean over 2 periods: AUC" in printed.out and "oracle AUC" in printed.out
    assert "period 3 (trained through 2): AUC" in caplog.text  # progress as it goes
    summary = json.loads((out / "replay.json").read_text())
    assert summary["periods"] == 3 and summary["period_rows"] == [512, 512, 512]
    results = summary["results"]
    assert len(results) == 2 and all(r["rows"] == 512 for r in results)
    assert all(0.5 < r["oracle_auc"] <= 1 and 0 < r["auc"] <= 1 for r in results)
    mean = sum(r["auc"] for r in results) / 2
    assert summary["mean"]["auc"] == pytest.approx(mean)
    assert (out / "replay.png").stat().st_size > 1000
    # The directory holds a replay now: a second one into it is refused.
    assert main(args) == 2
    assert "already holds a replay" in capsys.readouterr().err


def test_movielens_replay_by_calendar(tmp_path):
    config = load_config(
        None,
        [
            "data.source=movielens",
            "data.movielens.periods=3",
            "data.movielens.period_by=calendar",
            "model.embedding_dim=8",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "train.batch_size=4096",
            "train.progress=false",
        ],
    )
    _, summary = run_replay(config, progress=False)
    assert sum(summary["period_rows"]) == 100_836  # every rating of ml-latest-small
    assert [r["rows"] for r in summary["results"]] == summary["period_rows"][1:]
    assert all(r["oracle_auc"] is None for r in summary["results"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ([], "needs at least 2 periods.*data.synthetic.periods"),
        (["data.source=movielens"], "needs at least 2 periods.*data.movielens.periods"),
        ([*PERIODS, "optimizer.name=pb_lbfgs"], "draws its own samples"),
        ([*PERIODS, "plan.strategy=auto"], "plan.strategy = 'auto' measures"),
    ],
)
def test_replay_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        run_replay(load_config(None, SMALL + overrides), progress=False)


@pytest.mark.multiprocess
def test_two_ranks_replay_uneven_periods_like_one_process(tmp_path):
    """289 rows a period at a global batch of 64: the last batch (33 rows) splits 16/17
    over the ranks, and the evaluation shares (144/145 rows at 24 a batch) end unevenly."""
    overrides = [*SMALL, "data.synthetic.periods=3", "data.synthetic.period_samples=289"]
    overrides += ["train.batch_size=64", "train.eval_batch_size=48"]
    args = ["replay", "--nproc", "2", "--out", str(tmp_path / "two")]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 0
    two = json.loads((tmp_path / "two" / "replay.json").read_text())
    _, one = run_replay(load_config(None, overrides), progress=False)
    assert two["ranks"] == 2 and two["steps"] == one["steps"] == 15
    for a, b in zip(two["results"], one["results"], strict=True):
        assert a["rows"] == b["rows"] == 289  # every row of the period scored once
        assert a["oracle_auc"] == b["oracle_auc"]
        assert a["logloss"] == pytest.approx(b["logloss"], rel=1e-3)
