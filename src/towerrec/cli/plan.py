"""``towerrec plan``: plan a sharding, print it per device, write the JSON and a chart.

Tables come from the run config's data source (statistics measured on a few
batches), a statistics JSON (``--stats``) or a synthetic DLRM-like suite
(``--suite N``); the topology from the ``plan`` config section and
``--world-size``. ``--calibrate`` first measures this machine's kernels and
collectives (and the SSD and host memory, for tiers) and plans with the measured
constants. ``--profile`` plans memory tiers instead (cli/plan_tiers.py).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

from towerrec import calibration
from towerrec.build.planning import plan_source
from towerrec.build.sources import build_source
from towerrec.cli.common import add_config_args
from towerrec.cli.plan_learn import add_plan_commands
from towerrec.cli.plan_tiers import TIER_ONLY, add_tier_arguments, run_tiers
from towerrec.config import load_config
from towerrec.planner.report import device_table, write_bar_chart
from towerrec.planner.stats import load_stats, save_stats, stats_from_source
from towerrec.planner.suites import dlrm_like_suite

__all__ = ["add_commands"]

log = logging.getLogger("towerrec")


def add_commands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan", help="shard embedding tables over devices: per-device table, plan JSON, chart"
    )
    add_config_args(parser)
    parser.add_argument("--world-size", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument(
        "--planner",
        help="override plan.planner (search, lpt, greedy_*, random, neuroshard, dreamshard, "
        "autoshard)",
    )
    tables = parser.add_mutually_exclusive_group()
    tables.add_argument("--stats", type=Path, help="table statistics JSON instead of the data")
    tables.add_argument(
        "--suite", type=int, metavar="N", help="a synthetic DLRM-like suite of N tables"
    )
    parser.add_argument("--save-stats", type=Path, help="write the table statistics used here")
    parser.add_argument("--out", type=Path, default=Path("plan.json"), help="plan JSON to write")
    parser.add_argument("--png", type=Path, help="bar chart (default: --out with .png)")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's kernels and collectives (and the SSD at --ssd-path, host "
        "memory copies) first and plan with the result",
    )
    parser.add_argument(
        "--calibration-out",
        type=Path,
        default=Path("calibration.json"),
        help="where --calibrate writes the constants (plan.calibration reads them)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary, not the table")
    add_tier_arguments(parser)
    parser.set_defaults(func=_cmd_plan)
    add_plan_commands(
        parser.add_subparsers(
            dest="plan_command", title="learned planners' data and weights", required=False
        )
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    if args.planner:
        config = replace(config, plan=replace(config.plan, planner=args.planner))
    if args.calibrate:
        report = calibration.calibrate()
        # The SSD and host memory speeds the tier planner uses (a few seconds).
        storage_path = args.ssd_path or Path(args.calibration_out).resolve().parent
        report["storage"] = calibration.measure_storage(storage_path)
        Path(args.calibration_out).write_text(json.dumps(report, indent=2) + "\n")
        log.info("calibration written to %s", args.calibration_out)
        config = replace(config, plan=replace(config.plan, calibration=str(args.calibration_out)))
    if args.profile:
        ignored = [name for name in ("stats", "suite", "save_stats", "png", "planner")
                   if vars(args)[name]]  # fmt: skip
        if ignored:
            log.warning(
                "--profile plans memory tiers, not a sharding: ignoring %s",
                ", ".join("--" + name.replace("_", "-") for name in ignored),
            )
        return run_tiers(config, args)
    tier_only = [name for name in TIER_ONLY if vars(args)[name] is not None]
    if tier_only:
        log.warning(
            "%s only apply to tier planning: add --profile PROFILE (ignored now)",
            ", ".join("--" + name.replace("_", "-") for name in tier_only),
        )
    source = None
    if args.stats:
        stats = load_stats(args.stats)
    elif args.suite:
        stats = dlrm_like_suite(args.suite, batch_size=config.train.batch_size)
    else:
        source = build_source(config.data)
        stats = None
    result = plan_source(config, source, args.world_size, stats)
    if args.save_stats:
        save_stats(
            stats
            or stats_from_source(
                source,
                config.model.embedding_dim,
                config.plan.stats_batch_size,
                config.plan.stats_batches,
            ),
            args.save_stats,
        )
    result.plan.save(args.out)
    png = args.png or Path(args.out).with_suffix(".png")
    write_bar_chart(result, png)
    if args.json:
        print(json.dumps({**result.summary(), "plan": str(args.out), "chart": str(png)}, indent=2))
    else:
        print(device_table(result))
        print(f"plan written to {args.out}, chart to {png}")
    return 0
