"""``towerrec scaling fit``: a power law plus a constant along one axis of a sweep's runs
(``towerrec sweep``, cli/sweep.py), with intervals and a plot (towerrec/scaling.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_commands"]

AXES = ("examples", "params", "dense_params", "embedding_params", "flops", "compute")
METRICS = ("ne", "logloss")


def _cmd_fit(args: argparse.Namespace) -> int:
    from towerrec.scaling import fit_power_law, fit_relative, plot_fits
    from towerrec.workflows.sweep import read_runs

    runs = [r for r in read_runs(args.runs) if r.get("status") == "ok"]
    if args.where:
        runs = [r for r in runs if all(w in r["overrides"] for w in args.where)]
    points = [(r[args.x], r[args.y]) for r in runs if r.get(args.y) is not None]
    if not points:
        raise ValueError(f"{args.runs} has no finished run with {args.y} (see its failed points)")
    x, y = [p[0] for p in points], [p[1] for p in points]
    fit = fit_power_law(x, y, bootstrap=args.bootstrap, seed=args.seed)
    result: dict[str, object] = {"x": args.x, "y": args.y, "fit": fit.as_dict(), "points": points}
    warning = fit.warning(args.x, args.y)
    if warning:
        result["warning"] = warning
        print(f"warning: {warning}", file=sys.stderr)
    if args.baseline_logloss is not None:
        if args.y != "logloss":
            raise ValueError("--baseline-logloss fits the relative form of --y logloss")
        relative = fit_relative(x, y, args.baseline_logloss)
        result["relative"] = relative.as_dict()
    if args.plot:
        plot_fits({args.y: (x, y, fit)}, str(args.plot), args.x, args.y)
        result["plot"] = str(args.plot)
    print(json.dumps(result, indent=2))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    scaling = sub.add_parser("scaling", help="scaling-law fits of a sweep's runs")
    scaling_sub = scaling.add_subparsers(dest="scaling_command", required=True)
    fit = scaling_sub.add_parser(
        "fit", help="fit y = alpha * x^-beta + gamma along one axis (JSON on stdout)"
    )
    fit.add_argument("runs", type=Path, help="a sweep directory or its runs.jsonl")
    fit.add_argument("--x", choices=AXES, default="examples", help="the axis (default: examples)")
    fit.add_argument("--y", choices=METRICS, default="ne", help="the quality (default: ne)")
    fit.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only the points with this override (repeatable), e.g. model.name=wukong",
    )
    fit.add_argument("--bootstrap", type=int, default=1000, help="resamples for the intervals")
    fit.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    fit.add_argument(
        "--baseline-logloss",
        type=float,
        help="also fit Wukong's relative form: %% log-loss improvement per 4x of x",
    )
    fit.add_argument("--plot", type=Path, help="write the points and the curve to this PNG")
    fit.set_defaults(func=_cmd_fit)
