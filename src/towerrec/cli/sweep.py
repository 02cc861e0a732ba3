"""``towerrec sweep``: train every point of a grid into one runs file (workflows/sweep.py);
``towerrec scaling fit`` (cli/scaling.py) fits its runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from towerrec.cli.common import add_config_args

__all__ = ["add_commands"]


def _cmd_sweep(args: argparse.Namespace) -> int:
    from towerrec.workflows.sweep import run_sweep

    records = run_sweep(
        args.config, args.overrides, args.grid, args.out, nproc=args.nproc, hosts=args.hosts
    )
    failed = [r for r in records if r["status"] != "ok"]
    print(
        json.dumps(
            {
                "runs": str(Path(args.out) / "runs.jsonl"),
                "points": len(records),
                "failed": [{"overrides": r["overrides"], "error": r["error"]} for r in failed],
            },
            indent=2,
        )
    )
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    sweep = sub.add_parser("sweep", help="train every point of a grid into one runs file")
    add_config_args(sweep)
    sweep.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2,...",
        help="one axis of the grid (repeatable; the grid is their product), "
        "e.g. --grid model.embedding_dim=8,16,32",
    )
    sweep.add_argument("--out", type=Path, required=True, help="directory of the runs")
    sweep.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="run each point on N local worker processes, as towerrec train --nproc N",
    )
    sweep.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="let each point's N workers stand in for H hosts, as towerrec train --hosts H",
    )
    sweep.set_defaults(func=_cmd_sweep)
