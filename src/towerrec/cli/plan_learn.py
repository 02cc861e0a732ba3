"""``towerrec plan collect-costs | train-policy``: the data and weights of learned planners.

::

    towerrec plan collect-costs --out costs.json --devices 150 --seed 0
        measure random multi-table devices (forward, backward + update) and
        all-to-alls on this machine: the cost-data file (planner/costdata.py)
    towerrec plan train-policy --planner neuroshard --cost-data costs.json --out DIR --seed 0
        pre-train the planner's cost models on it: DIR/<planner>.pt + DIR/<planner>.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from towerrec.calibration.cost_data import collect_cost_data

__all__ = ["add_plan_commands"]

log = logging.getLogger("towerrec")


def add_plan_commands(actions: argparse._SubParsersAction) -> None:
    collect = actions.add_parser(
        "collect-costs",
        help="measure multi-table kernel and all-to-all costs for the learned planners",
    )
    collect.add_argument("--out", type=Path, required=True, help="cost-data JSON to write")
    collect.add_argument(
        "--devices", type=int, default=150, help="random devices to time (default 150)"
    )
    collect.add_argument(
        "--comm", type=int, default=40, help="random all-to-alls to time (default 40)"
    )
    collect.add_argument("--batch", type=int, default=2048, help="samples per rank (2048)")
    collect.add_argument("--reps", type=int, default=3, help="timed runs per sample (3)")
    collect.add_argument("--seed", type=int, default=0, help="draws the samples (default 0)")
    collect.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "fbgemm"),
        help="embedding kernel to time (default auto: this machine's choice)",
    )
    collect.set_defaults(func=_cmd_collect)


def _cmd_collect(args: argparse.Namespace) -> int:
    if args.devices < 0 or args.comm < 0:
        raise ValueError(f"--devices ({args.devices}) and --comm ({args.comm}) must be >= 0")
    data = collect_cost_data(
        args.devices, args.comm, args.batch, args.reps, args.seed, args.backend
    )
    data.save(args.out)
    print(
        f"cost data written to {args.out}: {len(data.compute)} devices, "
        f"{len(data.comm)} all-to-alls, {data.kernel} kernel"
    )
    return 0
