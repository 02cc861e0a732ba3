"""``towerrec nas search | retrain``: differentiable architecture search on DLRM."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from towerrec.cli.choices import NAS_SPACES
from towerrec.cli.common import add_config_args, add_override_args

__all__ = ["add_commands"]

log = logging.getLogger("towerrec")


def _cmd_search(args: argparse.Namespace) -> int:
    from towerrec.config import load_config
    from towerrec.workflows.nas.search import search

    overrides = list(args.overrides)
    if args.space:
        overrides.append(f"nas.space={args.space}")
    config = load_config(args.config, overrides)
    report = search(config, args.out, progress=config.train.progress)
    largest = report["largest_cost"]
    print(f"{report['space']} search, {report['steps']} steps; cost: {report['cost']}")
    for arch in report["architectures"]:
        val = arch["supernet_validation"]
        print(
            f"  {args.out / arch['file']}: cost {arch['cost']:,.0f} "
            f"({arch['cost'] / largest:.1%} of the largest), supernet validation AUC "
            f"{val['auc']:.4f}"
        )
    print(
        f"report in {args.out}/report.json and report.png; train one with "
        f"`towerrec nas retrain {args.out / 'arch-0.toml'}`"
    )
    return 0


def _cmd_retrain(args: argparse.Namespace) -> int:
    from towerrec.config import load_config
    from towerrec.train.run_dir import default_run_dir
    from towerrec.workflows.training import train

    config = load_config(args.arch, args.overrides)
    out = Path(args.out or default_run_dir())
    summary = train(config, out)
    line = f"AUC {summary['auc']:.4f}, log-loss {summary['logloss']:.4f}"
    if test := summary.get("test"):
        line += f"; test AUC {test['auc']:.4f}, log-loss {test['logloss']:.4f}"
    print(line)
    print(f"results in {out}/")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    nas = sub.add_parser("nas", help="differentiable architecture search (DNAS) on DLRM")
    nas_sub = nas.add_subparsers(dest="nas", required=True)
    search_cmd = nas_sub.add_parser(
        "search", help="search MLP widths/depth or per-table embedding dims/rows"
    )
    add_config_args(search_cmd)
    search_cmd.add_argument(
        "--space",
        choices=NAS_SPACES,
        help="the search space (default: nas.space of the config)",
    )
    search_cmd.add_argument("--out", type=Path, required=True, help="directory for the results")
    search_cmd.set_defaults(func=_cmd_search)
    retrain = nas_sub.add_parser(
        "retrain", help="train an architecture the search wrote (as towerrec train --config)"
    )
    retrain.add_argument("arch", type=Path, help="an arch-K.toml of a search directory")
    add_override_args(retrain, what="setting")
    retrain.add_argument("--out", type=Path, help="run directory (default: runs/train-<time>)")
    retrain.set_defaults(func=_cmd_retrain)
