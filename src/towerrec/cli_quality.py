"""``towerrec bench quality``: towerrec's models against plain-PyTorch references, JSON on stdout."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_bench_quality_command"]


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    from towerrec.bench.quality import QualitySettings, run_quality_benchmark
    from towerrec.bench.quality_reference import ReferenceSettings

    settings = QualitySettings(
        epochs=args.epochs,
        patience=args.patience,
        seeds=args.seeds,
        models=_names(args.models),
        datasets=_names(args.datasets),
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
    print(json.dumps(run_quality_benchmark(settings), indent=2))
    return 0


def add_bench_quality_command(bench_sub: argparse._SubParsersAction) -> None:
    from towerrec.bench.quality import CONFIGS, QualitySettings

    defaults = QualitySettings()
    recipe = defaults.reference
    b = bench_sub.add_parser(
        "quality",
        help="AUC and log-loss of towerrec's DLRM, DCNv2, Wukong vs plain-PyTorch references "
        "(MovieLens, generated Criteo-format data; seeds, early stopping)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object (always on)")
    b.add_argument("--epochs", type=int, default=defaults.epochs, help="epochs per run (at most)")
    b.add_argument(
        "--patience",
        type=int,
        default=defaults.patience,
        help="stop after this many epochs without a lower validation log-loss",
    )
    b.add_argument("--seeds", type=int, default=defaults.seeds, help="runs per model and side")
    b.add_argument("--models", default=",".join(defaults.models), help="comma-separated")
    b.add_argument("--datasets", default=",".join(defaults.datasets), help="comma-separated")
    b.add_argument("--movielens-config", type=Path, default=defaults.movielens_config)
    b.add_argument(
        "--movielens-path", default="", help="a MovieLens directory (default: the bundled one)"
    )
    b.add_argument(
        "--criteo-config",
        type=Path,
        default=CONFIGS / "criteo.toml" if (CONFIGS / "criteo.toml").is_file() else None,
        help="towerrec config for the Criteo-format data (default: configs/criteo.toml)",
    )
    b.add_argument("--criteo-files", type=int, default=defaults.criteo_files)
    b.add_argument("--criteo-rows", type=int, default=defaults.criteo_rows, help="rows per file")
    b.add_argument(
        "--criteo-num-embeddings",
        type=int,
        default=defaults.criteo_num_embeddings,
        help="hashed rows per table",
    )
    b.add_argument(
        "--data-dir",
        type=Path,
        help="keep the generated Criteo files and cache here (default: temp)",
    )
    b.add_argument("--threads", type=int, default=defaults.threads, help="torch threads")
    b.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="towerrec config override for every run (the reference has its own recipe)",
    )
    b.add_argument(
        "--reference-dense-lr",
        type=float,
        default=recipe.dense_lr,
        help="the reference's Adam learning rate (dense weights)",
    )
    b.add_argument(
        "--reference-embedding-lr",
        type=float,
        default=recipe.embedding_lr,
        help="the reference's Adagrad learning rate (embedding rows)",
    )
    b.set_defaults(func=_cmd_bench_quality)
