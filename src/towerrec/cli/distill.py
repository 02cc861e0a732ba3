"""``towerrec distill serve`` and ``towerrec data periods``: external distillation's data.

towerrec data periods OUT_DIR [--config FILE] [--periods A:B] [--id-offset N]
    a student's stream as period files with example ids (data/period_files.py)
towerrec distill serve --teacher EXPORT_DIR --watch STUDENT_DIR [--watch ...] --out OUT
    the augmentation service (workflows/distill/augment.py): follows the students' period files,
    scores each unique example once with the teacher, writes OUT/<student>/ shards
    that ``data.source = "augmented"``, ``data.augmented.dir = OUT/<student>`` reads
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from towerrec.build.sources import build_periods
from towerrec.cli.common import add_config_args
from towerrec.config import load_config
from towerrec.data.period_files import write_periods
from towerrec.data.registry import SOURCES
from towerrec.workflows.distill.augment import AugmentService

__all__ = ["add_commands", "add_periods_command"]

log = logging.getLogger("towerrec")


def _window(text: str) -> tuple[int, int | None]:
    start, sep, stop = text.partition(":")
    try:
        return int(start or 0), (int(stop) if stop else None) if sep else int(start) + 1
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a period window; give START:STOP (e.g. 0:4) or one period"
        ) from None


def _cmd_periods(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    if not SOURCES[config.data.source].raw:
        raise ValueError(
            f"data.source = {config.data.source!r} is the service's output; write period "
            "files from a raw source (synthetic, movielens, criteo or cache)"
        )
    source = build_periods(config.data)
    start, stop = args.periods
    window = range(start, source.num_periods if stop is None else stop)

    def said(period: int) -> None:
        log.info("wrote period %d of %d into %s", period + 1, len(window), args.out_dir)

    manifest = write_periods(
        source, args.out_dir, window, args.id_offset, f"data.source = {config.data.source}",
        on_period=said,
    )  # fmt: skip
    rows = manifest["stream"]["period_rows"]
    print(f"wrote {len(rows)} periods ({sum(rows)} rows) into {args.out_dir}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    service = AugmentService(args.teacher, args.watch, args.out, args.batch_size)
    try:
        counters = service.run(once=args.once, poll_s=args.poll_s)
    except KeyboardInterrupt:
        counters = service.write_counters()
        log.info("interrupted; every listed shard is complete, restart to go on")
    print(json.dumps({k: counters[k] for k in ("teacher_calls", "duplicates", "rows",
                                                "shards_written", "unique_examples")}))  # fmt: skip
    return 0


def add_periods_command(data_sub: argparse._SubParsersAction) -> None:
    periods = data_sub.add_parser(
        "periods", help="write a config's periods as period files with example ids"
    )
    periods.add_argument("out_dir", type=Path, help="directory to write (fresh)")
    add_config_args(periods)
    periods.add_argument(
        "--periods", type=_window, default=(0, None), metavar="START:STOP",
        help="a window of the source's periods (default: all); ids stay the stream's",
    )  # fmt: skip
    periods.add_argument(
        "--id-offset", type=int, default=0,
        help="added to every example id (the row's position in the source's stream)",
    )  # fmt: skip
    periods.set_defaults(func=_cmd_periods)


def add_commands(sub: argparse._SubParsersAction) -> None:
    distill = sub.add_parser("distill", help="external distillation: the augmentation service")
    distill_sub = distill.add_subparsers(dest="distill_command", required=True)
    serve = distill_sub.add_parser(
        "serve", help="score the students' period files with a teacher, once per example"
    )
    serve.add_argument("--teacher", type=Path, required=True, help="towerrec export directory")
    serve.add_argument(
        "--watch", type=Path, action="append", required=True, metavar="STUDENT_DIR",
        help="a student's period directory (towerrec data periods); repeatable",
    )  # fmt: skip
    serve.add_argument("--out", type=Path, required=True, help="output directory")
    serve.add_argument("--once", action="store_true", help="augment what is there, then exit")
    serve.add_argument("--poll-s", type=float, default=1.0, help="seconds between looks")
    serve.add_argument("--batch-size", type=int, default=4096, help="rows per teacher call")
    serve.set_defaults(func=_cmd_serve)
