"""``towerrec data pu-prior DATA_OR_CONFIG``: estimate the class prior of positive-unlabeled data.

    towerrec data pu-prior configs/movielens.toml --set data.movielens.pu_hide_fraction=0.5
    towerrec data pu-prior DIR                     a cache written by ``towerrec data``
    towerrec data pu-prior ML_DIR                  a MovieLens directory (ratings.csv, ...)

Labels 1 are labelled positives, labels 0 unlabelled. Prints JSON: ``prior``
(P(positive)), ``unlabelled_prior`` (P(positive | unlabelled), the value for
``loss.class_prior``), the label frequency and how it was found
(``workflows/pu/prior.py``; docs/pu_learning.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from towerrec.config import Config, load_config
from towerrec.workflows.pu.prior import FOLDS, TOP_FRACTION, estimate_class_prior

__all__ = ["add_pu_prior_command", "config_of"]


def config_of(target: Path, overrides: list[str]) -> Config:
    """The run config ``target`` names: a TOML config file, a cache directory (with a
    manifest) or a MovieLens directory (with ratings.csv); then ``overrides``."""
    if target.is_file():
        return load_config(target, overrides)
    if (target / "ratings.csv").is_file():
        return load_config(None, ["data.source=movielens", f"data.path={target}", *overrides])
    if (target / "manifest.json").is_file():
        return load_config(None, ["data.source=cache", f"data.path={target}", *overrides])
    raise FileNotFoundError(
        f"{target} is neither a config file, a cache directory (with manifest.json, from "
        "`towerrec data`) nor a MovieLens directory (with ratings.csv)"
    )


def _cmd_pu_prior(args: argparse.Namespace) -> int:
    config = config_of(args.target, args.overrides)
    estimate = estimate_class_prior(config, folds=args.folds, top_fraction=args.top_fraction)
    print(json.dumps(estimate.as_dict(), indent=1))
    return 0


def add_pu_prior_command(data_sub: argparse._SubParsersAction) -> None:
    pu = data_sub.add_parser(
        "pu-prior",
        help="estimate the class prior of positive-unlabeled data (labels 0 = unlabelled)",
    )
    pu.add_argument("target", type=Path, metavar="DATA_OR_CONFIG")
    pu.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.steps=200 (repeatable)",
    )
    pu.add_argument(
        "--folds", type=int, default=FOLDS, help="cross-fitting folds over the training rows"
    )
    pu.add_argument(
        "--top-fraction",
        type=float,
        default=TOP_FRACTION,
        help="share of held-out examples, scored highest, whose labelled share estimates c",
    )
    pu.set_defaults(func=_cmd_pu_prior)
