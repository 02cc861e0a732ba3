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

from towerrec.cli.choices import PU_FOLDS, PU_TOP_FRACTION
from towerrec.cli.common import add_override_args, config_of

__all__ = ["add_commands"]


def _cmd_pu_prior(args: argparse.Namespace) -> int:
    from towerrec.workflows.pu.prior import estimate_class_prior

    config = config_of(args.target, args.overrides)
    estimate = estimate_class_prior(config, folds=args.folds, top_fraction=args.top_fraction)
    print(json.dumps(estimate.as_dict(), indent=1))
    return 0


def add_commands(data_sub: argparse._SubParsersAction) -> None:
    pu = data_sub.add_parser(
        "pu-prior",
        help="estimate the class prior of positive-unlabeled data (labels 0 = unlabelled)",
    )
    pu.add_argument("target", type=Path, metavar="DATA_OR_CONFIG")
    add_override_args(pu, "train.steps=200")
    pu.add_argument(
        "--folds", type=int, default=PU_FOLDS, help="cross-fitting folds over the training rows"
    )
    pu.add_argument(
        "--top-fraction",
        type=float,
        default=PU_TOP_FRACTION,
        help="share of held-out examples, scored highest, whose labelled share estimates c",
    )
    pu.set_defaults(func=_cmd_pu_prior)
