"""``towerrec data periods OUT_DIR``: a student's stream as period files with example ids.

    towerrec data periods OUT_DIR [--config FILE] [--periods A:B] [--id-offset N]

Writes a config's periods (data/period_files.py) for the augmentation service
(``towerrec distill serve``, cli/distill.py) to score with a teacher.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from towerrec.cli.common import add_config_args

__all__ = ["add_commands"]

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
    from towerrec.build.sources import build_periods
    from towerrec.config import load_config
    from towerrec.data.period_files import write_periods
    from towerrec.data.registry import SOURCES

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


def add_commands(data_sub: argparse._SubParsersAction) -> None:
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
