"""``towerrec bench quality``: towerrec's DLRM, DCNv2 and Wukong against the recipes CTR
practitioners train them with, written in plain PyTorch, on the same rows.

::

    data set (quality_data.py) ─► train / validation / test splits (the same rows)
         │                                   │
         ▼                                   ▼
    towerrec: train(config) as the     references (quality_reference.py, plain torch):
    named config says; a validation    FuxiCTR's recipe and TorchRec/dlrm's, each with
    and a test evaluation each epoch   its own init, optimizers and early stopping, a
         │                             validation and a test evaluation each epoch
         └────────► both selection rules on every side ◄────────┘
                    the epoch of best validation log-loss, and of best validation AUC:
                    that epoch's test AUC and log-loss

towerrec trains its config (``--config NAME=PATH``; default the packaged recipe NAME
when there is one, ``towerrec config recipes``, else for a ``--data`` cache the recipe its
converter prints, without a bottom MLP where it has no dense features, else the built-in
defaults) as ``towerrec train`` would, with a validation
every epoch (``train.eval_every = "epoch"``); ``--set`` changes it on every data set. The
references get the same features, splits, model kind, embedding dim and batch size (the
config's; ``--reference-dim`` gives them another dim) and train at their recipes' own MLP
widths (``quality_reference.py``; ``--reference-widths config``: the config's widths too).
Seed s sets model init and data order on every side.

Verdict per data set, model and selection rule: towerrec's mean test AUC minus the
better reference's is at least ``-max(std_towerrec, std_reference)`` ("within one
standard deviation or above").

Beside the models of ``--models``, each data set also trains the plain DNN (``--no-dnn``
skips it): every embedding and the raw dense features concatenated into the FuxiCTR
recipe's top MLP, the first model a practitioner writes. ``best_of_each`` then sets
towerrec's best model against the best plain model of any kind, each side's best chosen by
its mean validation value of the rule's metric, and judges their test AUCs as above: what
a user who tries every model on each side and keeps the best would see.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.bench.quality_data import (
    BUILT_IN,
    LARGE_TABLES,
    RAW_UNITS,
    SYNTHETIC,
    DataSet,
    cache_overrides,
    criteo_cache,
    movielens_overrides,
    plain_data,
    unseen_id_rows,
    write_synthetic_cache,
)
from towerrec.bench.quality_models import Architecture, PlainData
from towerrec.bench.quality_reference import (
    RECIPES,
    SELECTION_RULES,
    Recipe,
    recipe_architecture,
    selections,
    train_reference,
    with_overrides,
)
from towerrec.config import Config, load_config
from towerrec.config.recipes import recipe_for_cache, recipe_names, recipe_path
from towerrec.data.cache import read_manifest
from towerrec.train.hooks import StepHook
from towerrec.train.loop import validate
from towerrec.train.metrics import EvalMetrics
from towerrec.train.session import Session
from towerrec.workflows.training import train

__all__ = ["BENCHMARK", "QualitySettings", "run_quality_benchmark"]

MODELS = ("dlrm", "dcn", "wukong")
# The references' MLP widths: their recipes' own | the config's.
REFERENCE_WIDTHS = ("published", "config")


@dataclass(frozen=True)
class QualitySettings:
    """What ``towerrec bench quality`` runs (the CLI's flags)."""

    epochs: int = 15  # the references' cap on epochs
    seeds: int = 3
    models: tuple[str, ...] = MODELS
    datasets: tuple[str, ...] = BUILT_IN
    configs: dict[str, Path] = field(default_factory=dict)  # data set -> towerrec config
    data: dict[str, Path] = field(default_factory=dict)  # NAME -> cache / MovieLens dir
    synthetic_rows: int = 200_000  # training rows written from the stream
    synthetic_held_out: int = 50_000  # validation rows, and as many test rows
    criteo_files: int = 3
    criteo_rows: int = 30_000  # per file
    criteo_num_embeddings: int = 20_000  # hashed rows per table
    data_dir: Path | None = None  # where generated data goes; None: a temp dir
    movielens_path: str = ""  # empty: the bundled data set
    overrides: tuple[str, ...] = ()  # towerrec config overrides for every run
    threads: int = 1
    recipes: tuple[Recipe, ...] = tuple(RECIPES.values())
    reference_widths: str = "published"  # the recipes' own MLP widths | "config": towerrec's
    dnn: bool = True  # also the plain DNN (concatenated embeddings into an MLP)
    reference_dim: int | None = None  # the references' embedding dim; None: the config's

    def __post_init__(self) -> None:
        if self.reference_widths not in REFERENCE_WIDTHS:
            raise ValueError(
                f"bench quality: --reference-widths {self.reference_widths!r} is not "
                f"{' or '.join(REFERENCE_WIDTHS)}"
            )
        if self.reference_dim is not None and self.reference_dim < 1:
            raise ValueError("bench quality: --reference-dim must be >= 1")
        for key in ("epochs", "seeds", "criteo_files", "criteo_rows", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"bench quality: --{key.replace('_', '-')} must be >= 1")
        unknown = sorted(set(self.models) - set(MODELS))
        if unknown or not self.models:
            raise ValueError(f"bench quality: --models takes some of {', '.join(MODELS)}")
        known = (*BUILT_IN, *self.data)
        unknown = sorted(set(self.datasets) - set(known))
        if unknown or not self.datasets:
            raise ValueError(
                f"bench quality: --datasets {','.join(unknown)}: each is one of "
                f"{', '.join(known)}; name another with --data NAME=PATH"
            )
        for name in self.configs:
            if name not in self.datasets:
                raise ValueError(
                    f"bench quality: --config {name}=...: {name!r} is not among --datasets"
                )

    def config_of(self, name: str, cache: Path | None = None) -> Path | None:
        """towerrec's config for data set ``name``: ``--config``'s, else the packaged recipe
        of that name, else for a cache (``cache``, or the ``--data`` one) the recipe its
        converter prints (``recipe_for_cache``), else the defaults."""
        if name in self.configs:
            return self.configs[name]
        if name in recipe_names():
            return recipe_path(name)
        manifest = _cache_manifest(cache or self.data.get(name))
        if manifest is None:
            return None
        chosen = recipe_for_cache(manifest["schema"], manifest["rows"]["train"]).name
        return recipe_path(chosen) if chosen else None


def _cache_manifest(path: Path | None) -> dict[str, Any] | None:
    """A cache directory's manifest, checked as the loader checks it (None: no cache
    there, e.g. a MovieLens directory)."""
    if path is None or not (path / "manifest.json").is_file():
        return None
    return read_manifest(path)


# ------------------------------------------------------------------ data sets
def _data_set(name: str, settings: QualitySettings, root: Path) -> DataSet:
    config = settings.config_of(name)
    if name == "movielens":
        return DataSet(name, config, movielens_overrides(config, settings.movielens_path))
    if name == "criteo":
        path = criteo_cache(
            root / "criteo",
            settings.criteo_files,
            settings.criteo_rows,
            settings.criteo_num_embeddings,
        )
        return DataSet(name, config, cache_overrides(path))
    path = settings.data.get(name)
    if name in SYNTHETIC:
        written = ("data.source=synthetic", *SYNTHETIC[name])
        base = DataSet(name, config, written).load(settings.overrides)
        path = write_synthetic_cache(
            base,
            root / name,
            settings.synthetic_rows,
            settings.synthetic_held_out,
            raw=name in RAW_UNITS,
        )
        config = settings.config_of(name, path)
    assert path is not None  # (a name the settings checked)
    overrides = cache_overrides(path)
    manifest = _cache_manifest(path)
    no_dense = manifest is not None and not manifest["schema"].get("num_dense")
    if no_dense and load_config(config, list(overrides)).model.bottom_mlp:
        overrides = (*overrides, "model.bottom_mlp=[]")  # as the converter prints it
    return DataSet(name, config, overrides)


# ------------------------------------------------------------------ towerrec's side
def _label(where: str, seeds: int, side: str, seed: int) -> str:
    return f"{where} {side} seed {seed + 1}/{seeds}"


def _progress(label: str, record: dict[str, Any]) -> None:
    """One epoch of one run, on stderr (stdout is for the JSON result)."""
    print(
        f"bench quality: {label}, epoch {record['epoch']}: validation AUC "
        f"{record['validation']['auc']:.4f}, test AUC {record['test']['auc']:.4f}",
        file=sys.stderr,
        flush=True,
    )


class _TestEachValidation(StepHook):
    """After each validation, the test split's metrics too (the validation's, without one);
    each epoch's line on stderr."""

    def __init__(self, label: str, per_epoch: int) -> None:
        self.label, self.per_epoch = label, per_epoch
        self.records: list[dict[str, Any]] = []

    def setup(self, session: Session) -> None:
        self.session = session

    def on_validation(self, step: int, metrics: EvalMetrics) -> None:
        validation = _metrics(metrics.as_dict())
        test = validation
        if self.session.source.test_rows:
            test = _metrics(validate(self.session, "test").as_dict())
        self.records.append({"step": step, "validation": validation, "test": test})
        epoch = -(-step // self.per_epoch)
        _progress(self.label, {"epoch": epoch, "validation": validation, "test": test})


def _metrics(record: dict[str, Any]) -> dict[str, float]:
    return {"auc": float(record["auc"]), "logloss": float(record["logloss"])}


def _towerrec_run(
    config: Config, train_rows: int, seed: int, root: Path, label: str, threads: int
) -> dict:
    """One towerrec run at ``threads`` intra-op threads, the references' (``--threads``):
    its bits then do not depend on the machine's cores."""
    run_config = replace(
        config,
        train=replace(
            config.train,
            eval_every="epoch",
            seed=seed,
            progress=False,
            device="cpu",
            threads=threads,
        ),
        data=replace(config.data, loader=replace(config.data.loader, seed=seed)),
    )
    per_epoch = -(-train_rows // config.train.batch_size)
    hook = _TestEachValidation(label, per_epoch)
    out = Path(tempfile.mkdtemp(dir=root))
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for the JSON result
        summary = train(run_config, out, hooks=[hook])
    epochs = [{"epoch": -(-r.pop("step") // per_epoch), **r} for r in hook.records]
    return {"seed": seed, "num_dense_params": summary["num_dense_params"], "epochs": epochs}


# ------------------------------------------------------------------ the references' side
def _architecture(config: Config) -> Architecture:
    m = config.model
    if m.dcn.structure != "stacked" or m.wukong.dense_rows != 1:
        raise ValueError("bench quality: the reference has the stacked DCN and dense_rows = 1")
    return Architecture(
        model=m.name,
        embedding_dim=m.embedding_dim,
        bottom_mlp=tuple(m.bottom_mlp),
        top_mlp=tuple(m.top_mlp),
        self_interaction=m.self_interaction,
        concat_embeddings=m.concat_embeddings and m.name == "dlrm",
        dropout=m.dropout,
        batch_norm=m.batch_norm,
        dcn_layers=m.dcn.num_layers,
        dcn_rank=m.dcn.rank,
        wukong_layers=m.wukong.num_layers,
        wukong_fm=m.wukong.num_fm,
        wukong_lcb=m.wukong.num_lcb,
        wukong_rank=m.wukong.fm_rank,
        wukong_fm_mlp=tuple(m.wukong.fm_mlp),
    )


def _with_dim(arch: Architecture, dim: int | None) -> Architecture:
    """``arch`` at embedding dim ``dim`` (None: as it is); the bottom MLP ends at it."""
    if dim is None:
        return arch
    bottom = (*arch.bottom_mlp[:-1], dim) if arch.bottom_mlp else ()
    return replace(arch, embedding_dim=dim, bottom_mlp=bottom)


def _reference_architecture(
    config: Config, recipe: Recipe, widths: str, dim: int | None = None
) -> Architecture:
    arch = _with_dim(_architecture(config), dim)
    return recipe_architecture(arch, recipe) if widths == "published" else arch


def _dnn_architecture(
    config: Config, recipe: Recipe, widths: str, dim: int | None = None
) -> Architecture:
    """The plain DNN: the config's embedding dim (or ``dim``), the raw dense features, and
    the recipe's top MLP (``widths = "config"``: the config's); no dropout or batch norm."""
    top = recipe.top_mlp if widths == "published" and recipe.top_mlp else config.model.top_mlp
    return Architecture("dnn", dim or config.model.embedding_dim, (), tuple(top))


def _reference_run(
    arch: Architecture,
    config: Config,
    data: tuple[PlainData, PlainData, PlainData | None],
    recipe: Recipe,
    seed: int,
    epochs: int,
    label: str,
) -> dict:
    result = train_reference(
        arch,
        *data,
        recipe=recipe,
        epochs=epochs,
        batch_size=config.train.batch_size,
        seed=seed,
        on_epoch=lambda record: _progress(label, record),
    )
    return {"seed": seed, "num_dense_params": result.num_dense_params, "epochs": result.epochs}


# ------------------------------------------------------------------ statistics
def _side(runs: list[dict], arch: Architecture) -> dict:
    """Mean and standard deviation over seeds of each selection rule's test metrics."""
    out: dict[str, Any] = {
        "num_dense_params": runs[0]["num_dense_params"],
        "embedding_dim": arch.embedding_dim,
        "bottom_mlp": list(arch.bottom_mlp),
        "top_mlp": list(arch.top_mlp),
    }
    for run in runs:
        chosen = selections(run["epochs"])
        run["selected"] = {
            rule: {
                "epoch": r["epoch"],
                **{k: round(v, 5) for k, v in r["test"].items()},
                **{f"validation_{k}": round(v, 5) for k, v in r["validation"].items()},
            }
            for rule, r in chosen.items()
        }
        run["epochs_trained"] = run["epochs"][-1]["epoch"]
    for rule in SELECTION_RULES:
        stats: dict[str, Any] = {}
        for key in ("auc", "logloss"):
            values = [run["selected"][rule][key] for run in runs]
            stats[key] = round(statistics.fmean(values), 5)
            stats[f"{key}_std"] = round(statistics.stdev(values), 5) if len(values) > 1 else 0.0
            values = [run["selected"][rule][f"validation_{key}"] for run in runs]
            stats[f"validation_{key}"] = round(statistics.fmean(values), 5)
        stats["epochs"] = [run["selected"][rule]["epoch"] for run in runs]
        out[f"by_{rule}"] = stats
    out["per_seed"] = runs
    return out


def _verdicts(sides: dict[str, dict]) -> dict:
    """Per selection rule: towerrec's mean test AUC against the better reference's."""
    out = {}
    for rule in SELECTION_RULES:
        key = f"by_{rule}"
        references = {name: s[key] for name, s in sides.items() if name != "towerrec"}
        best = max(references, key=lambda name: references[name]["auc"])
        ours, theirs = sides["towerrec"][key], references[best]
        diff = ours["auc"] - theirs["auc"]
        out[key] = {
            "better_reference": best,
            "auc_towerrec_minus_better_reference": round(diff, 5),
            "towerrec_within_one_std_or_above": diff >= -max(ours["auc_std"], theirs["auc_std"]),
        }
    return out


def _best_of_each(result: dict) -> dict:
    """Per selection rule: towerrec's best model against the best plain model of any kind
    (every reference and the DNN), each side's best chosen as a user would, by its mean
    validation value of the rule's metric; then their test AUCs."""
    out = {}
    for rule in SELECTION_RULES:
        key = f"by_{rule}"
        ours: dict[str, dict] = {}
        plain: dict[str, dict] = {}
        for model, sides in result["models"].items():
            for side, stats in sides.items():
                if side == "towerrec":
                    ours[model] = stats[key]
                elif side != "verdict":
                    plain[f"{model} {side}"] = stats[key]
        if result.get("dnn"):
            plain["dnn fuxictr"] = result["dnn"][key]
        better = functools.partial(_validation_score, rule)
        mine, theirs = max(ours, key=lambda n: better(ours[n])), None
        if plain:
            theirs = max(plain, key=lambda n: better(plain[n]))
        record: dict[str, Any] = {"towerrec": {"model": mine, **_summary(ours[mine])}}
        if theirs is not None:
            a, b = ours[mine], plain[theirs]
            diff = a["auc"] - b["auc"]
            record["plain"] = {"model": theirs, **_summary(b)}
            record["auc_towerrec_minus_plain"] = round(diff, 5)
            record["towerrec_within_one_std_or_above"] = diff >= -max(a["auc_std"], b["auc_std"])
        out[key] = record
    return out


def _validation_score(rule: str, stats: dict) -> float:
    """The higher the better: mean validation AUC, or minus mean validation log-loss."""
    value = stats[f"validation_{rule}"]
    return value if rule == "auc" else -value


def _summary(stats: dict) -> dict:
    keys = ("auc", "auc_std", "validation_auc", "validation_logloss")
    return {k: stats[k] for k in keys}


def _evaluate_data_set(data_set: DataSet, settings: QualitySettings, root: Path) -> dict:
    config = data_set.load(settings.overrides)
    data = plain_data(config)
    result: dict[str, Any] = {
        "config": str(data_set.config) if data_set.config else "built-in defaults",
        "overrides": [*data_set.overrides, *settings.overrides],
        "batch_size": config.train.batch_size,
        "train_rows": data[0].rows,
        "validation_rows": data[1].rows,
        "test_rows": data[2].rows if data[2] is not None else 0,
        "test_split": "test" if data[2] is not None else "validation (the data has no test split)",
        # per feature: the share of held-out rows with an id no training row has
        "unseen_id_rows": {
            split: unseen_id_rows(data[0], rows)
            for split, rows in (("validation", data[1]), ("test", data[2]))
            if rows is not None
        },
        "models": {},
    }
    for model in settings.models:
        model_config = data_set.load([*settings.overrides, f"model.name={model}"])
        seeds = range(settings.seeds)
        label = functools.partial(_label, f"{data_set.name} {model}", settings.seeds)
        sides = {
            "towerrec": _side(
                [
                    _towerrec_run(
                        model_config,
                        data[0].rows,
                        s,
                        root,
                        label("towerrec", s),
                        settings.threads,
                    )
                    for s in seeds
                ],
                _architecture(model_config),
            )
        }
        for recipe in settings.recipes:
            arch = _reference_architecture(
                model_config, recipe, settings.reference_widths, settings.reference_dim
            )
            runs = [
                _reference_run(
                    arch, model_config, data, recipe, s, settings.epochs, label(recipe.name, s)
                )
                for s in seeds
            ]
            sides[recipe.name] = _side(runs, arch)
        result["models"][model] = {**sides, "verdict": _verdicts(sides)}
        print(f"bench quality: {data_set.name} {model} done", file=sys.stderr)
    if settings.dnn:
        recipe = next((r for r in settings.recipes if r.name == "fuxictr"), RECIPES["fuxictr"])
        arch = _dnn_architecture(config, recipe, settings.reference_widths, settings.reference_dim)
        label = functools.partial(_label, f"{data_set.name} dnn", settings.seeds)
        runs = [
            _reference_run(arch, config, data, recipe, s, settings.epochs, label(recipe.name, s))
            for s in range(settings.seeds)
        ]
        result["dnn"] = {"recipe": recipe.name, **_side(runs, arch)}
    result["best_of_each"] = _best_of_each(result)
    return result


def run_quality_benchmark(settings: QualitySettings) -> dict:
    torch.set_num_threads(settings.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data_root = settings.data_dir or root
        datasets = {
            name: _evaluate_data_set(_data_set(name, settings, data_root), settings, root)
            for name in settings.datasets
        }
    return {
        "benchmark": "quality",
        "machine": machine_info(),
        "seeds": settings.seeds,
        "reference_max_epochs": settings.epochs,
        "selection_rules": {
            "by_logloss": "the epoch of lowest validation log-loss among those trained",
            "by_auc": "the epoch of highest validation AUC among those trained",
        },
        "recipes": {r.name: r.as_dict() for r in settings.recipes},
        "reference_widths": settings.reference_widths,
        "reference_dim": settings.reference_dim,
        "generated_data": {
            "synthetic": {
                "train_rows": settings.synthetic_rows,
                "held_out_rows": settings.synthetic_held_out,
            },
            "synthetic-large": {
                "train_rows": settings.synthetic_rows,
                "held_out_rows": settings.synthetic_held_out,
                "num_embeddings": list(LARGE_TABLES),
            },
            "synthetic-raw": {
                "train_rows": settings.synthetic_rows,
                "held_out_rows": settings.synthetic_held_out,
                "dense": "column j is s_j exp(x_j) of the planted x, s_j from 1 to 1,000",
            },
            "criteo": {
                "files": settings.criteo_files,
                "rows_per_file": settings.criteo_rows,
                "num_embeddings": settings.criteo_num_embeddings,
                "validation_fraction": 0.1,
                "test_fraction": 0.1,
            },
        },
        "verdict_rule": "towerrec mean test AUC - the better reference's >= "
        "-max(std_towerrec, std_reference), per selection rule",
        "best_of_each_rule": "per data set and selection rule: towerrec's model of best mean "
        "validation value against the plain model (any kind, any recipe, the DNN) of best "
        "mean validation value; their mean test AUCs, judged as verdict_rule",
        "dnn": settings.dnn,
        "datasets": datasets,
    }


# ------------------------------------------------------------------ command line
def _named_paths(items: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"bench quality: {flag} takes NAME=PATH, got {item!r}")
        out[name] = Path(path)
    return out


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = QualitySettings()
    fuxictr, torchrec = RECIPES["fuxictr"], RECIPES["torchrec"]
    add = parser.add_argument
    add("--epochs", type=int, default=defaults.epochs, help="the references' cap on epochs")
    add("--seeds", type=int, default=defaults.seeds, help="runs per model and side")
    add("--models", default=",".join(defaults.models), help="comma-separated")
    add(
        "--datasets",
        default=",".join(defaults.datasets),
        help="comma-separated: synthetic, synthetic-large, synthetic-raw, movielens, criteo and the names given "
        "with --data",
    )
    add(
        "--data",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="one more data set: a cache directory (`towerrec data ...`, e.g. a libFM one) "
        "or a MovieLens directory (repeatable); add NAME to --datasets",
    )
    add(
        "--config",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="towerrec's config for data set NAME, a file or a recipe (default: the recipe NAME "
        "when there is one, else for a --data cache the recipe its converter prints, else the "
        "built-in defaults; repeatable)",
    )
    add("--recipes", default=",".join(RECIPES), help="the references: fuxictr, torchrec")
    add(
        "--reference-widths",
        choices=REFERENCE_WIDTHS,
        default=defaults.reference_widths,
        help="the references' MLP widths: their recipes' own (published) or towerrec's config's",
    )
    add(
        "--reference-dim",
        type=int,
        help="the references' embedding dim (default: the config's, as towerrec's side; "
        "their bottom MLPs then end at it)",
    )
    add(
        "--no-dnn",
        dest="dnn",
        action="store_false",
        help="skip the plain DNN (every embedding and the dense features concatenated into an "
        "MLP, FuxiCTR's recipe) that best_of_each sets against towerrec's best model",
    )
    add("--synthetic-rows", type=int, default=defaults.synthetic_rows, help="training rows")
    add(
        "--synthetic-held-out",
        type=int,
        default=defaults.synthetic_held_out,
        help="validation rows, and as many test rows",
    )
    add("--movielens-path", default="", help="a MovieLens directory (default: the bundled one)")
    add("--criteo-files", type=int, default=defaults.criteo_files)
    add("--criteo-rows", type=int, default=defaults.criteo_rows, help="rows per file")
    add(
        "--criteo-num-embeddings",
        type=int,
        default=defaults.criteo_num_embeddings,
        help="hashed rows per table",
    )
    add("--data-dir", type=Path, help="keep the generated data here (default: temp)")
    add("--threads", type=int, default=defaults.threads, help="torch threads")
    add_overrides_argument(
        parser, "towerrec config override for every run (the references have their recipes)"
    )
    add("--patience", type=int, help=f"both references' patience (default {fuxictr.patience})")
    add("--fuxictr-lr", type=float, help=f"its Adam rate (default {fuxictr.dense_lr})")
    add("--fuxictr-l2", type=float, help=f"its L2 on looked-up rows ({fuxictr.embedding_l2})")
    add(
        "--fuxictr-init-std",
        type=float,
        help=f"its embedding init std (default {fuxictr.init.std})",
    )
    add(
        "--fuxictr-embedding-optimizer",
        choices=("adam", "sparse_adam"),
        help=f"its rows' Adam: on dense gradients, every row every step (default "
        f"{fuxictr.embedding_optimizer}), or sparse_adam, the looked-up rows alone (as "
        "towerrec's adam; without the L2, which needs dense gradients)",
    )
    add(
        "--torchrec-embedding-optimizer",
        choices=("rowwise_adagrad", "adagrad", "sgd"),
        help=f"its row optimizer (default {torchrec.embedding_optimizer})",
    )
    add("--torchrec-embedding-lr", type=float, help=f"(default {torchrec.embedding_lr})")
    add("--torchrec-dense-lr", type=float, help=f"its Adam rate (default {torchrec.dense_lr})")


def _recipes(args: argparse.Namespace) -> tuple[Recipe, ...]:
    names = comma_list(args.recipes)
    unknown = sorted(set(names) - set(RECIPES))
    if unknown or not names:
        raise ValueError(f"bench quality: --recipes takes some of {', '.join(RECIPES)}")
    fuxictr = RECIPES["fuxictr"]
    if args.fuxictr_init_std is not None:
        fuxictr = replace(fuxictr, init=replace(fuxictr.init, std=args.fuxictr_init_std))
    if args.fuxictr_embedding_optimizer == "sparse_adam" and args.fuxictr_l2 is None:
        fuxictr = replace(fuxictr, embedding_l2=0.0)  # an L2 needs dense gradients
    changed = {
        "fuxictr": with_overrides(
            fuxictr,
            embedding_optimizer=args.fuxictr_embedding_optimizer,
            patience=args.patience,
            dense_lr=args.fuxictr_lr,
            embedding_lr=args.fuxictr_lr,
            embedding_l2=args.fuxictr_l2,
        ),
        "torchrec": with_overrides(
            RECIPES["torchrec"],
            patience=args.patience,
            embedding_optimizer=args.torchrec_embedding_optimizer,
            embedding_lr=args.torchrec_embedding_lr,
            dense_lr=args.torchrec_dense_lr,
        ),
    }
    return tuple(changed[name] for name in names)


def _run(args: argparse.Namespace) -> dict:
    settings = QualitySettings(
        epochs=args.epochs,
        seeds=args.seeds,
        models=comma_list(args.models),
        datasets=comma_list(args.datasets),
        configs=_named_paths(args.config, "--config"),
        data=_named_paths(args.data, "--data"),
        synthetic_rows=args.synthetic_rows,
        synthetic_held_out=args.synthetic_held_out,
        criteo_files=args.criteo_files,
        criteo_rows=args.criteo_rows,
        criteo_num_embeddings=args.criteo_num_embeddings,
        data_dir=args.data_dir,
        movielens_path=args.movielens_path,
        overrides=tuple(args.overrides),
        threads=args.threads,
        recipes=_recipes(args),
        reference_widths=args.reference_widths,
        dnn=args.dnn,
        reference_dim=args.reference_dim,
    )
    return run_quality_benchmark(settings)


BENCHMARK = Benchmark(
    "test AUC of towerrec's DLRM, DCNv2, Wukong vs FuxiCTR's and TorchRec's recipes in plain "
    "PyTorch (synthetic, MovieLens, Criteo-format, libFM caches; seeds, both selection rules)",
    _add_arguments,
    _run,
)
