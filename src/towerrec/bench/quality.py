"""``towerrec bench quality``: towerrec's DLRM, DCNv2 and Wukong against plain-PyTorch
references of the same architectures, on real and Criteo-format data.

::

    data set ─► towerrec's loader ─► train / validation split (the same rows)
                    │                              │
                    ▼                              ▼
    towerrec: train(config) for E epochs,   reference (quality_reference.py): its own
    an eval every epoch (metrics.jsonl)     tables, MLPs, interactions, optimizers and
                    │                       loop on plain tensors, an eval every epoch
                    └──────────► same early-stopping rule ◄──────────┘
                                 best epoch by validation log-loss

Data sets: the bundled MovieLens (its time split: the last 20 % of ratings are the
validation rows) and Criteo-format files generated here (``gen-criteo``, seeded) and
converted with a seeded 10 % validation split. The towerrec data loader is used on
the reference side only to materialise that split as tensors, so both see identical
rows; the reference imports nothing else of towerrec (and not even that: it gets
tensors).

Both sides train E epochs at the towerrec config's batch size, evaluate on the
validation rows after every epoch, and report the epoch of lowest validation
log-loss among those seen before ``patience`` epochs pass without a lower one. The
reference stops there; towerrec trains all E epochs (its LR schedule spans them) and
the rule is applied to its per-epoch evaluations, which gives the same choice.
Seed s sets model init and data order on both sides (towerrec: ``train.seed``,
``data.loader.seed``). Verdict per model: towerrec's mean AUC minus the reference's
is at least ``-max(std_towerrec, std_reference)`` ("within one standard deviation
or above").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.bench.quality_reference import (
    Architecture,
    Bag,
    PlainData,
    ReferenceSettings,
    train_reference,
)
from towerrec.build.sources import build_source
from towerrec.config import Config, load_config
from towerrec.data.batch import Batch
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.data.loader import ColumnSource
from towerrec.workflows.training import train

__all__ = [
    "BENCHMARK",
    "QualitySettings",
    "early_stopped",
    "plain_data",
    "run_quality_benchmark",
]

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MODELS = ("dlrm", "dcn", "wukong")
DATASETS = ("movielens", "criteo")


@dataclass(frozen=True)
class QualitySettings:
    """What ``towerrec bench quality`` runs (the CLI's flags)."""

    epochs: int = 4
    patience: int = 1
    seeds: int = 3
    models: tuple[str, ...] = MODELS
    datasets: tuple[str, ...] = DATASETS
    movielens_config: Path = CONFIGS / "movielens.toml"
    criteo_config: Path | None = None  # None: the built-in defaults (configs/default.toml)
    criteo_files: int = 3
    criteo_rows: int = 30_000  # per file
    criteo_num_embeddings: int = 20_000  # hashed rows per table
    data_dir: Path | None = None  # where the Criteo files and cache go; None: a temp dir
    movielens_path: str = ""  # empty: the bundled data set
    overrides: tuple[str, ...] = ()  # towerrec config overrides for every run
    threads: int = 1
    reference: ReferenceSettings = field(default_factory=ReferenceSettings)

    def __post_init__(self) -> None:
        for key in ("epochs", "patience", "seeds", "criteo_files", "criteo_rows", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"bench quality: --{key.replace('_', '-')} must be >= 1")
        for name, allowed in (("models", MODELS), ("datasets", DATASETS)):
            unknown = sorted(set(getattr(self, name)) - set(allowed))
            if unknown or not getattr(self, name):
                raise ValueError(f"bench quality: --{name} takes some of {', '.join(allowed)}")


# ------------------------------------------------------------------ data
def _plain(batch: Batch, sizes: list[int]) -> PlainData:
    bags = []
    for (_, jagged), size in zip(batch.sparse.to_dict().items(), sizes):
        bags.append(Bag(jagged.values.long(), jagged.offsets(), size))
    return PlainData(batch.dense.float(), batch.labels.float(), tuple(bags))


def plain_data(config: Config) -> tuple[PlainData, PlainData]:
    """The train and validation (eval) rows of ``config.data`` as plain tensors."""
    source = build_source(config.data)
    if not isinstance(source, ColumnSource):
        raise ValueError(
            f"the plain-PyTorch references read a data set's rows, but data.source = "
            f"{config.data.source!r} is a stream; use a cache or MovieLens"
        )
    sizes = [f.num_embeddings for f in source.schema.sparse]
    train_rows = source.train_batch(0, source.train_rows)  # epoch 0: every row once
    valid = list(source.eval_batches(source.eval_rows))
    assert len(valid) == 1  # one batch of every eval row
    return _plain(train_rows, sizes), _plain(valid[0], sizes)


def _criteo_cache(settings: QualitySettings, root: Path) -> Path:
    raw = root / "criteo-raw"
    paths = generate_criteo_files(raw, settings.criteo_files, settings.criteo_rows, seed=0)
    options = CriteoOptions(
        num_embeddings=(settings.criteo_num_embeddings,), eval_fraction=0.1, seed=0
    )
    with contextlib.redirect_stdout(sys.stderr):
        preprocess_criteo(paths, root / "criteo-cache", options, progress=False)
    return root / "criteo-cache"


# ------------------------------------------------------------------ runs
def early_stopped(evals: list[dict], patience: int) -> dict:
    """The epoch record of lowest log-loss seen before ``patience`` epochs pass without a
    lower one (``evals`` in epoch order)."""
    best = 0
    for i in range(1, len(evals)):
        if evals[i]["logloss"] < evals[best]["logloss"]:
            best = i
        elif i - best >= patience:
            break
    return evals[best]


def _architecture(config: Config) -> Architecture:
    m = config.model
    if m.dcn.structure != "stacked" or m.wukong.dense_rows != 1:
        raise ValueError("bench quality: the reference has the stacked DCN and dense_rows = 1")
    return Architecture(
        model=m.name,
        embedding_dim=m.embedding_dim,
        bottom_mlp=tuple(m.bottom_mlp),
        top_mlp=tuple(m.top_mlp),
        dcn_layers=m.dcn.num_layers,
        dcn_rank=m.dcn.rank,
        wukong_layers=m.wukong.num_layers,
        wukong_fm=m.wukong.num_fm,
        wukong_lcb=m.wukong.num_lcb,
        wukong_rank=m.wukong.fm_rank,
        wukong_fm_mlp=tuple(m.wukong.fm_mlp),
    )


def _towerrec_run(
    config: Config, train_rows: int, seed: int, settings: QualitySettings, root: Path
) -> dict:
    per_epoch = -(-train_rows // config.train.batch_size)
    steps = -(-settings.epochs * train_rows // config.train.batch_size)
    run_config = replace(
        config,
        train=replace(
            config.train,
            steps=steps,
            epochs=None,
            eval_every=per_epoch,
            log_every=per_epoch,
            seed=seed,
            progress=False,
            device="cpu",
            threads=0,
        ),
        data=replace(config.data, loader=replace(config.data.loader, seed=seed)),
    )
    out = Path(tempfile.mkdtemp(dir=root))
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for the JSON result
        summary = train(run_config, out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [
        {"epoch": -(-r["step"] // per_epoch), "auc": r["auc"], "logloss": r["logloss"]}
        for r in records
        if r.get("kind") == "eval"
    ]
    best = early_stopped(evals, settings.patience)
    return {
        "seed": seed,
        "best_epoch": best["epoch"],
        **_rounded(best),
        "num_dense_params": summary["num_dense_params"],
        "epochs": evals,
    }


def _reference_run(
    config: Config, data: tuple[PlainData, PlainData], seed: int, settings: QualitySettings
) -> dict:
    result = train_reference(
        _architecture(config),
        *data,
        epochs=settings.epochs,
        batch_size=config.train.batch_size,
        patience=settings.patience,
        seed=seed,
        settings=settings.reference,
    )
    best = {"auc": result.auc, "logloss": result.logloss}
    return {
        "seed": seed,
        "best_epoch": result.best_epoch,
        **_rounded(best),
        "num_dense_params": result.num_dense_params,
        "epochs": result.epochs,
    }


def _rounded(record: dict) -> dict:
    return {k: round(record[k], 5) for k in ("auc", "logloss")}


def _stats(runs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for key in ("auc", "logloss"):
        values = [r[key] for r in runs]
        out[key] = round(statistics.fmean(values), 5)
        out[f"{key}_std"] = round(statistics.stdev(values), 5) if len(values) > 1 else 0.0
    out["num_dense_params"] = runs[0]["num_dense_params"]
    out["per_seed"] = runs
    return out


def _compare(towerrec: dict, reference: dict) -> dict:
    diff = towerrec["auc"] - reference["auc"]
    band = max(towerrec["auc_std"], reference["auc_std"])
    return {
        "auc_towerrec_minus_reference": round(diff, 5),
        "logloss_towerrec_minus_reference": round(towerrec["logloss"] - reference["logloss"], 5),
        "towerrec_within_one_std_or_above": diff >= -band,
    }


def _dataset(
    name: str, base: tuple[Path | None, list[str]], settings: QualitySettings, root: Path
) -> dict:
    path, data_overrides = base
    overrides = [*data_overrides, *settings.overrides]
    config = load_config(path, overrides)
    data = plain_data(config)
    result: dict[str, Any] = {
        "config": str(path) if path else "built-in defaults",
        "overrides": overrides,
        "batch_size": config.train.batch_size,
        "train_rows": data[0].rows,
        "validation_rows": data[1].rows,
        "models": {},
    }
    for model in settings.models:
        model_config = load_config(path, [*overrides, f"model.name={model}"])
        seeds = range(settings.seeds)
        towerrec = _stats(
            [_towerrec_run(model_config, data[0].rows, s, settings, root) for s in seeds]
        )
        reference = _stats([_reference_run(model_config, data, s, settings) for s in seeds])
        result["models"][model] = {
            "towerrec": towerrec,
            "reference": reference,
            **_compare(towerrec, reference),
        }
        print(f"bench quality: {name} {model} done", file=sys.stderr)
    return result


def run_quality_benchmark(settings: QualitySettings) -> dict:
    torch.set_num_threads(settings.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data_root = settings.data_dir or root
        datasets: dict[str, Any] = {}
        for name in settings.datasets:
            if name == "movielens":
                base: tuple[Path | None, list[str]] = (
                    settings.movielens_config,
                    ["data.source=movielens", f"data.path={json.dumps(settings.movielens_path)}"],
                )
            else:
                cache = _criteo_cache(settings, data_root)
                base = (
                    settings.criteo_config,
                    ["data.source=criteo", f"data.path={json.dumps(str(cache))}"],
                )
            datasets[name] = _dataset(name, base, settings, root)
    return {
        "benchmark": "quality",
        "machine": machine_info(),
        "epochs": settings.epochs,
        "patience": settings.patience,
        "seeds": settings.seeds,
        "criteo_data": {
            "files": settings.criteo_files,
            "rows_per_file": settings.criteo_rows,
            "num_embeddings": settings.criteo_num_embeddings,
            "validation_fraction": 0.1,
        },
        "reference_settings": settings.reference.as_dict(),
        "verdict_rule": "towerrec mean AUC - reference mean AUC >= -max(std_towerrec, std_reference)",
        "datasets": datasets,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = QualitySettings()
    recipe = defaults.reference
    add = parser.add_argument
    add("--epochs", type=int, default=defaults.epochs, help="epochs per run (at most)")
    add(
        "--patience",
        type=int,
        default=defaults.patience,
        help="stop after this many epochs without a lower validation log-loss",
    )
    add("--seeds", type=int, default=defaults.seeds, help="runs per model and side")
    add("--models", default=",".join(defaults.models), help="comma-separated")
    add("--datasets", default=",".join(defaults.datasets), help="comma-separated")
    add("--movielens-config", type=Path, default=defaults.movielens_config)
    add("--movielens-path", default="", help="a MovieLens directory (default: the bundled one)")
    add(
        "--criteo-config",
        type=Path,
        default=CONFIGS / "criteo.toml" if (CONFIGS / "criteo.toml").is_file() else None,
        help="towerrec config for the Criteo-format data (default: configs/criteo.toml)",
    )
    add("--criteo-files", type=int, default=defaults.criteo_files)
    add("--criteo-rows", type=int, default=defaults.criteo_rows, help="rows per file")
    add(
        "--criteo-num-embeddings",
        type=int,
        default=defaults.criteo_num_embeddings,
        help="hashed rows per table",
    )
    add(
        "--data-dir",
        type=Path,
        help="keep the generated Criteo files and cache here (default: temp)",
    )
    add("--threads", type=int, default=defaults.threads, help="torch threads")
    add_overrides_argument(
        parser, "towerrec config override for every run (the reference has its own recipe)"
    )
    add(
        "--reference-dense-lr",
        type=float,
        default=recipe.dense_lr,
        help="the reference's Adam learning rate (dense weights)",
    )
    add(
        "--reference-embedding-lr",
        type=float,
        default=recipe.embedding_lr,
        help="the reference's Adagrad learning rate (embedding rows)",
    )


def _run(args: argparse.Namespace) -> dict:
    settings = QualitySettings(
        epochs=args.epochs,
        patience=args.patience,
        seeds=args.seeds,
        models=comma_list(args.models),
        datasets=comma_list(args.datasets),
        movielens_config=args.movielens_config,
        criteo_config=args.criteo_config,
        criteo_files=args.criteo_files,
        criteo_rows=args.criteo_rows,
        criteo_num_embeddings=args.criteo_num_embeddings,
        data_dir=args.data_dir,
        movielens_path=args.movielens_path,
        overrides=tuple(args.overrides),
        threads=args.threads,
        reference=ReferenceSettings(
            dense_lr=args.reference_dense_lr, embedding_lr=args.reference_embedding_lr
        ),
    )
    return run_quality_benchmark(settings)


BENCHMARK = Benchmark(
    "AUC and log-loss of towerrec's DLRM, DCNv2, Wukong vs plain-PyTorch references "
    "(MovieLens, generated Criteo-format data; seeds, early stopping)",
    _add_arguments,
    _run,
)
