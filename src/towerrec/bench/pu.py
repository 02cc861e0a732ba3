"""``towerrec bench pu``: positive-unlabeled learning on MovieLens with hidden positives.

::

    MovieLens (rating >= 4 positive), split by time: train | validation | test
    PU view: half of the train and validation positives relabelled 0 (seeded),
             the test split keeps the true labels
        │
        ├─► naive     loss.kind = "bce"      (hidden positives taken as negatives)
        ├─► pu_true   loss.kind = "pu_bce"   class_prior = the true share of positives
        │                                    among the unlabelled training examples
        ├─► pu_est    loss.kind = "pu_bce"   class_prior estimated from the PU training
        │                                    data (workflows/pu/prior.py)
        └─► full      loss.kind = "bce" on the true labels (nothing hidden): the reference

Each variant trains the same model, steps and seed; reported on the test split
against the true labels: mean prediction over the true positive rate
(``calibration``; target within 10 %, the naive model's about half), log-loss
(target: below naive), AUC (target: no more than 0.003 below naive); and the
estimator's error on the prior (target within 0.05). One row per seed (the seed of
the hidden positives, the model and the data order), then the means.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import replace
from typing import Any

import numpy as np

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.config import Config, LossConfig, load_config
from towerrec.data.movielens import bundled_movielens_path, load_movielens
from towerrec.workflows.pu.prior import FOLDS, estimate_class_prior
from towerrec.workflows.training import train

__all__ = ["BENCHMARK", "run_pu"]

VARIANTS = ("full", "naive", "pu_true", "pu_est")


# configs/movielens.toml's model and optimizer, one epoch (200 steps of 1,024 overfit the
# smaller training split that a test split leaves), with a test split.
MOVIELENS = [
    "data.source=movielens",
    "model.bottom_mlp=[32, 16]",
    "embedding.lr=0.05",
    "optimizer.warmup_steps=20",
    "train.epochs=1",
    "train.batch_size=1024",
]


def _config(seed: int, hide: float, overrides: list[str]) -> Config:
    return load_config(
        None,
        [
            *MOVIELENS,
            "data.movielens.test_fraction=0.2",
            f"data.movielens.pu_hide_fraction={hide}",
            f"data.movielens.pu_seed={seed}",
            f"train.seed={seed}",
            f"data.loader.seed={seed}",
            "train.eval_every=0",
            "train.progress=false",
            *overrides,
        ],
    )


def true_priors(config: Config) -> dict[str, float]:
    """Of the training split: P(positive), and P(positive | unlabelled) in the PU view."""
    path = config.data.path or bundled_movielens_path()
    ml = config.data.movielens
    truth = load_movielens(path, replace(ml, pu_hide_fraction=0.0))
    observed = load_movielens(path, ml)
    y = np.concatenate([p.labels for p in truth.splits["train"]])
    s = np.concatenate([p.labels for p in observed.splits["train"]])
    return {"prior": float(y.mean()), "unlabelled_prior": float(y[s == 0].mean())}


def _train(config: Config, kind: str, prior: float | None) -> dict[str, float]:
    """Test metrics (true labels) of ``config`` trained with ``loss.kind = kind``."""
    config = replace(config, loss=LossConfig(kind=kind, class_prior=prior))
    with tempfile.TemporaryDirectory() as out:
        summary = train(config, out)
    test = summary["test"]
    return {k: test[k] for k in ("auc", "logloss", "calibration")}


def run_pu(seeds: tuple[int, ...], hide: float, folds: int, overrides: list[str]) -> dict:
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        config = _config(seed, hide, overrides)
        truth = true_priors(config)
        estimate = estimate_class_prior(config, folds=folds)
        row: dict[str, Any] = {
            "seed": seed,
            "true_prior": truth["prior"],
            "true_unlabelled_prior": truth["unlabelled_prior"],
            "estimated_prior": estimate.prior,
            "estimated_unlabelled_prior": estimate.unlabelled_prior,
            "prior_error": abs(estimate.prior - truth["prior"]),
            "unlabelled_prior_error": abs(estimate.unlabelled_prior - truth["unlabelled_prior"]),
            "full": _train(_config(seed, 0.0, overrides), "bce", None),
            "naive": _train(config, "bce", None),
            "pu_true": _train(config, "pu_bce", truth["unlabelled_prior"]),
            "pu_est": _train(config, "pu_bce", estimate.unlabelled_prior),
        }
        rows.append(row)

    def mean(get) -> float:
        return statistics.fmean(get(r) for r in rows)

    summary: dict[str, Any] = {
        v: {m: mean(lambda r, v=v, m=m: r[v][m]) for m in ("auc", "logloss", "calibration")}
        for v in VARIANTS
    }
    summary["prior_error"] = mean(lambda r: r["prior_error"])
    summary["unlabelled_prior_error"] = mean(lambda r: r["unlabelled_prior_error"])
    targets = {
        f"{v}_calibration_within_10pct": abs(summary[v]["calibration"] - 1) <= 0.1
        for v in ("pu_true", "pu_est")
    }
    for v in ("pu_true", "pu_est"):
        targets[f"{v}_logloss_below_naive"] = summary[v]["logloss"] < summary["naive"]["logloss"]
        targets[f"{v}_auc_within_0.003_of_naive"] = (
            summary[v]["auc"] >= summary["naive"]["auc"] - 0.003
        )
    targets["prior_error_within_0.05"] = summary["prior_error"] <= 0.05
    return {
        "benchmark": "pu",
        "data": "movielens (bundled), rating >= 4 positive, time split 60/20/20",
        "hide_fraction": hide,
        "folds": folds,
        "seeds": list(seeds),
        "per_seed": rows,
        "mean": summary,
        "targets_met": targets,
        "machine": machine_info(),
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=comma_list, default=("0", "1", "2"))
    parser.add_argument("--hide", type=float, default=0.5, help="share of positives hidden")
    parser.add_argument("--folds", type=int, default=FOLDS, help="estimator cross-fitting folds")
    add_overrides_argument(parser)


def _run(args: argparse.Namespace) -> dict:
    return run_pu(tuple(int(s) for s in args.seeds), args.hide, args.folds, args.overrides)


BENCHMARK = Benchmark(
    help="PU learning on MovieLens with hidden positives: naive BCE vs pu_bce (JSON)",
    add_arguments=_add_arguments,
    run=_run,
)
