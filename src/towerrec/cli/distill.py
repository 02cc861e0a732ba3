"""``towerrec distill serve``: the augmentation service of external distillation.

towerrec distill serve --teacher EXPORT_DIR --watch STUDENT_DIR [--watch ...] --out OUT
    the augmentation service (workflows/distill/augment.py): follows the students' period files
    (``towerrec data periods``, cli/data/periods.py), scores each unique example once
    with the teacher, writes OUT/<student>/ shards that ``data.source = "augmented"``,
    ``data.augmented.dir = OUT/<student>`` reads
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

__all__ = ["add_commands"]

log = logging.getLogger("towerrec")


def _cmd_serve(args: argparse.Namespace) -> int:
    from towerrec.workflows.distill.augment import AugmentService

    service = AugmentService(args.teacher, args.watch, args.out, args.batch_size)
    try:
        counters = service.run(once=args.once, poll_s=args.poll_s)
    except KeyboardInterrupt:
        counters = service.write_counters()
        log.info("interrupted; every listed shard is complete, restart to go on")
    print(json.dumps({k: counters[k] for k in ("teacher_calls", "duplicates", "rows",
                                                "shards_written", "unique_examples")}))  # fmt: skip
    return 0


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
