"""``towerrec plan collect-costs | train-policy``: the data and weights of learned planners.

::

    towerrec plan collect-costs --out costs.json --devices 400 --seed 0
        measure random multi-table devices (forward, backward + update) and
        all-to-alls on this machine: the cost-data file (planner/costdata.py)
    towerrec plan train-policy --planner neuroshard --cost-data costs.json --out DIR --seed 0
        pre-train the planner's cost models on it: DIR/<planner>.pt + DIR/<planner>.json
        (dreamshard, autoshard: the cost network, then the placement policy trained on
        its estimates: DIR/<planner>.pt)
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from towerrec.calibration.cost_data import collect_cost_data
from towerrec.planner.costdata import CostData
from towerrec.planner.learned_planners import train_policy
from towerrec.planner.neuroshard import train_neuroshard, write_policy

__all__ = ["add_plan_commands"]

log = logging.getLogger("towerrec")


def add_plan_commands(actions: argparse._SubParsersAction) -> None:
    collect = actions.add_parser(
        "collect-costs",
        help="measure multi-table kernel and all-to-all costs for the learned planners",
    )
    collect.add_argument("--out", type=Path, required=True, help="cost-data JSON to write")
    collect.add_argument(
        "--devices", type=int, default=400, help="random devices to time (default 400)"
    )
    collect.add_argument(
        "--comm", type=int, default=60, help="random all-to-alls to time (default 60)"
    )
    collect.add_argument(
        "--batch",
        type=int,
        default=2048,
        help="samples a device's kernel processes, and each rank's in the all-to-all (2048)",
    )
    collect.add_argument(
        "--reps", type=int, default=5, help="timed runs per sample, the fastest kept (5)"
    )
    collect.add_argument("--seed", type=int, default=0, help="draws the samples (default 0)")
    collect.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "fbgemm"),
        help="embedding kernel to time (default auto: this machine's choice)",
    )
    collect.set_defaults(func=_cmd_collect)

    train = actions.add_parser(
        "train-policy", help="pre-train a learned planner's models on a cost-data file"
    )
    train.add_argument(
        "--planner", required=True, choices=tuple(TRAINERS), help="which planner to train"
    )
    train.add_argument(
        "--cost-data", type=Path, required=True, help="from `towerrec plan collect-costs`"
    )
    train.add_argument(
        "--out", type=Path, required=True, help="directory for <planner>.pt and <planner>.json"
    )
    train.add_argument("--seed", type=int, default=0, help="initialisation and split (0)")
    train.add_argument(
        "--steps", type=int, default=1500, help="optimizer steps per model (neuroshard)"
    )
    train.set_defaults(func=_cmd_train)


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


def _train_neuroshard(args: argparse.Namespace) -> Path:
    data = CostData.load(args.cost_data)
    policy = train_neuroshard(data, seed=args.seed, steps=args.steps)
    info = policy.info
    log.info(
        "neuroshard: held-out median relative error %.3f (compute), %.3f (all-to-all fit)",
        info["compute_held_out_median_rel_error"],
        info["comm_median_rel_error"],
    )
    return write_policy(policy, data, args.cost_data, args.out)


def _train_placement_policy(args: argparse.Namespace) -> Path:
    """DreamShard or AutoShard: the policy trained on the cost network's estimates."""
    args.out.mkdir(parents=True, exist_ok=True)
    return train_policy(args.planner, args.cost_data, args.out, seed=args.seed)


TRAINERS = {
    "neuroshard": _train_neuroshard,
    "dreamshard": _train_placement_policy,
    "autoshard": _train_placement_policy,
}


def _cmd_train(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    weights = TRAINERS[args.planner](args)
    record = weights.with_suffix(".json")
    also = f" (and {record})" if record.exists() else ""
    print(f"{args.planner} weights written to {weights}{also}")
    return 0
