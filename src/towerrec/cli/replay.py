"""``towerrec replay``: train through time-ordered periods, scoring each on the next."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

from towerrec.cli.common import add_config_args

__all__ = ["add_commands"]


def _cmd_replay(args: argparse.Namespace) -> int:
    from towerrec.config import load_config
    from towerrec.distributed.launch import WorkerError, launch
    from towerrec.workflows.replay.replay import check_out_dir, replay, replay_worker

    config = load_config(args.config, args.overrides)  # checked before any worker starts
    out = args.out or Path("runs") / datetime.now().strftime("replay-%Y%m%d-%H%M%S")
    if args.nproc > 1 and config.train.temporal.strategy == "fgd":
        raise ValueError(
            "train.temporal.strategy = 'fgd' runs on one process: drop --nproc, or use "
            "strategy 'incremental' or 'batch'"
        )
    if args.nproc > 1:
        check_out_dir(out)
        try:
            results = launch(replay_worker, (args.config, args.overrides, out), nproc=args.nproc)
        except WorkerError as e:
            raise ValueError(f"a worker failed: {e}") from None
        summary = results[0]
    else:
        summary = replay(config, out)
    mean = summary["mean"]
    line = f"mean over {len(summary['results'])} periods: AUC {mean['auc']:.4f}"
    if mean["oracle_auc"] is not None:
        line += f" (oracle AUC {mean['oracle_auc']:.4f})"
    print(f"{line}, log-loss {mean['logloss']:.4f}, NE {mean['ne']:.4f}")
    print(f"results in {out}/ (replay.json, replay.png)")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "replay",
        help="rolling evaluation on time-ordered data: train through period t, score period t+1",
    )
    add_config_args(parser)
    parser.add_argument("--out", type=Path, help="output directory (default: runs/replay-<time>)")
    parser.add_argument(
        "--nproc", type=int, default=1, help="start N local worker processes (gloo on CPU)"
    )
    parser.set_defaults(func=_cmd_replay)
