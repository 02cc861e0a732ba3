"""``towerrec bench init``: embedding init rules (with the embedding optimizer and
learning rate each needs) against each other, as test AUC over seeds, on the data
shapes the default must serve.

::

    data set      built here (seeded) or the cache a --set points at
        │
        ▼
    variant x seed: train(config + variant + seed) to convergence: an eval every
    epoch, early stopping on validation AUC (--patience), at most --epochs epochs,
    the test split scored with the weights of the best validation
        │
        ▼
    per variant: test AUC mean and std over seeds; the best variant per data set, and
    every variant within one std of it ("within noise")

Data sets (``--data``):

    movielens   the bundled ml-latest-small (the default model), rating
                >= 4 a click, time split: train, the next 20 % validation, the
                latest 10 % test
    context     the small-vocabulary libFM set of ``towerrec data gen-context`` (10
                one-hot fields, tables of 3 to 9,744 rows), converted with
                ``towerrec data libfm`` (its validation and test files); the
                converter's printed model (no bottom MLP)
    criteo      Criteo-format files of ``towerrec data gen-criteo`` (seeded),
                converted with a seeded 10 % validation and 10 % test split
    synthetic   the planted data (its own eval set as validation; no test split:
                the validation AUC of the best eval is reported)

Seed s sets the weights and the data order (``train.seed``, ``data.loader.seed``).
Runs use ``train.threads = --threads`` (1: a loaded machine's cores are not
oversubscribed; the AUC does not depend on it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.config import load_config

__all__ = ["BENCHMARK", "DATASETS", "VARIANTS", "run_init_benchmark"]

# Variant name -> its overrides: init rule and scale, embedding optimizer and its lr
# ("uniform_rows-adagrad" is the default before init_scale existed; "default": today's).
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "uniform_rows-adagrad": (
        'embedding.init="uniform_rows"',
        'embedding.optimizer="rowwise_adagrad"',
        "embedding.lr=0.5",
    ),
    "uniform_rows-adagrad_0.05": (
        'embedding.init="uniform_rows"',
        'embedding.optimizer="rowwise_adagrad"',
        "embedding.lr=0.05",
    ),
    "uniform_rows-adam": (
        'embedding.init="uniform_rows"',
        'embedding.optimizer="adam"',
        "embedding.lr=0.001",
    ),
    "normal_0.01-adagrad": (
        'embedding.init="normal_scale"',
        "embedding.init_scale=0.01",
        'embedding.optimizer="rowwise_adagrad"',
        "embedding.lr=0.5",
    ),
    "normal_0.01-adagrad_0.05": (
        'embedding.init="normal_scale"',
        "embedding.init_scale=0.01",
        'embedding.optimizer="rowwise_adagrad"',
        "embedding.lr=0.05",
    ),
    "normal_0.01-adam": (
        'embedding.init="normal_scale"',
        "embedding.init_scale=0.01",
        'embedding.optimizer="adam"',
        "embedding.lr=0.001",
    ),
    "normal_1e-4-adam": (
        'embedding.init="normal_scale"',
        "embedding.init_scale=0.0001",
        'embedding.optimizer="adam"',
        "embedding.lr=0.001",
    ),
}


def _movielens(work: Path) -> tuple[str, ...]:
    return (
        "data.source=movielens",
        "data.movielens.test_fraction=0.1",
        "data.movielens.eval_fraction=0.2",
    )


def _context(work: Path) -> tuple[str, ...]:
    from towerrec.data.context_gen import generate_context_files
    from towerrec.data.libfm import preprocess_libfm
    from towerrec.data.movielens import bundled_movielens_path
    from towerrec.data.splits import Split

    cache = work / "context-cache"
    if not (cache / "manifest.json").exists():
        files = work / "context"
        generate_context_files(bundled_movielens_path(), files)
        split = Split(
            eval_files=(str(files / "validation.libfm"),),
            test_files=(str(files / "test.libfm"),),
        )
        inputs: list[str | Path] = [
            str(files / f"{s}.libfm") for s in ("train", "validation", "test")
        ]
        with contextlib.redirect_stdout(sys.stderr):
            preprocess_libfm(inputs, cache, files / "fields.txt", split=split)
    return ("data.source=cache", f"data.path={cache}", "model.bottom_mlp=[]")


def _criteo(work: Path) -> tuple[str, ...]:
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo
    from towerrec.data.criteo_gen import generate_criteo_files

    cache = work / "criteo-cache"
    if not (cache / "manifest.json").exists():
        paths = generate_criteo_files(work / "criteo-raw", 3, 30_000, seed=0)
        options = CriteoOptions(
            num_embeddings=(20_000,), eval_fraction=0.1, test_fraction=0.1, seed=0
        )
        with contextlib.redirect_stdout(sys.stderr):
            preprocess_criteo(paths, cache, options, progress=False)
    return ("data.source=cache", f"data.path={cache}")


def _synthetic(work: Path) -> tuple[str, ...]:
    return ("data.source=synthetic",)


# Data set name -> its overrides (building its files under the work directory first).
DATASETS: dict[str, Callable[[Path], tuple[str, ...]]] = {
    "movielens": _movielens,
    "context": _context,
    "criteo": _criteo,
    "synthetic": _synthetic,
}


def _run_one(
    data: str, base: tuple[str, ...], variant: str, seed: int, settings: dict[str, Any]
) -> dict[str, Any]:
    from towerrec.workflows.training import train

    schedule = (
        [f"train.steps={settings['synthetic_steps']}", "train.eval_every=250"]
        if data == "synthetic"
        else [f"train.epochs={settings['epochs']}", 'train.eval_every="epoch"']
    )
    overrides = [
        *base,
        *schedule,
        "train.early_stopping.metric=auc",
        f"train.early_stopping.patience={settings['patience']}",
        f"train.seed={seed}",
        f"data.loader.seed={seed}",
        f"train.threads={settings['threads']}",
        "train.progress=false",
        "train.log_every=100000",
        *VARIANTS[variant],
        *settings["overrides"],
    ]
    config = load_config(None, overrides)
    with tempfile.TemporaryDirectory() as out:
        summary = train(config, out)
    scored = summary.get("test") or summary["best_validation"]
    return {
        "seed": seed,
        "test_auc": round(scored["auc"], 5),
        "test_logloss": round(scored["logloss"], 5),
        "validation_auc": round(summary["best_validation"]["auc"], 5),
        "best_step": summary["best_step"],
        "steps": summary["steps"],
    }


def _stats(runs: list[dict[str, Any]]) -> dict[str, float]:
    aucs = [r["test_auc"] for r in runs]
    return {
        "mean": round(statistics.fmean(aucs), 5),
        "std": round(statistics.stdev(aucs), 5) if len(aucs) > 1 else 0.0,
    }


def run_init_benchmark(
    datasets: tuple[str, ...],
    variants: tuple[str, ...],
    seeds: tuple[int, ...],
    settings: dict[str, Any],
    work: Path | None = None,
) -> dict[str, Any]:
    for name, known, what in (("--data", DATASETS, datasets), ("--variants", VARIANTS, variants)):
        unknown = sorted(set(what) - set(known))
        if unknown or not what:
            raise ValueError(
                f"bench init: {name} {','.join(unknown) or '(empty)'}: choose among "
                f"{', '.join(known)}"
            )
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        root = work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        for data in datasets:
            base = DATASETS[data](root)
            per: dict[str, Any] = {}
            for variant in variants:
                runs = [_run_one(data, base, variant, s, settings) for s in seeds]
                per[variant] = {"test_auc": _stats(runs), "runs": runs}
                print(f"{data} {variant}: {per[variant]['test_auc']}", file=sys.stderr)
            best = max(per, key=lambda v: per[v]["test_auc"]["mean"])
            top = per[best]["test_auc"]
            within = [
                v
                for v in per
                if per[v]["test_auc"]["mean"]
                >= top["mean"] - max(top["std"], per[v]["test_auc"]["std"])
            ]
            results[data] = {"variants": per, "best": best, "within_noise_of_best": within}
    return {
        "benchmark": "init",
        "seeds": list(seeds),
        "settings": {k: v for k, v in settings.items() if k != "overrides"},
        "overrides": list(settings["overrides"]),
        "variants": {v: list(VARIANTS[v]) for v in variants},
        "datasets": results,
        "machine": machine_info(),
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        type=comma_list,
        default=("movielens", "context", "criteo", "synthetic"),
        help=f"data sets: {', '.join(DATASETS)}",
    )
    parser.add_argument(
        "--variants",
        type=comma_list,
        default=tuple(VARIANTS),
        help=f"init rule and embedding optimizer pairs: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--seeds", type=comma_list, default=("0", "1", "2"))
    parser.add_argument("--epochs", type=int, default=20, help="cap on epochs (real data)")
    parser.add_argument("--patience", type=int, default=2, help="evals without a better AUC")
    parser.add_argument("--synthetic-steps", type=int, default=2500)
    parser.add_argument("--threads", type=int, default=1, help="train.threads of each run")
    parser.add_argument("--work", type=Path, help="where the built data sets go (kept)")
    add_overrides_argument(parser)


def _run(args: argparse.Namespace) -> dict:
    settings = {
        "epochs": args.epochs,
        "patience": args.patience,
        "synthetic_steps": args.synthetic_steps,
        "threads": args.threads,
        "overrides": tuple(args.overrides),
    }
    seeds = tuple(int(s) for s in args.seeds)
    return run_init_benchmark(args.data, args.variants, seeds, settings, args.work)


BENCHMARK = Benchmark(
    help="embedding init rules and optimizers: test AUC over seeds per data set (JSON)",
    add_arguments=_add_arguments,
    run=_run,
)
