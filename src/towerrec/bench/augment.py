"""``towerrec bench augment``: throughput of the augmentation service and of a student
reading its shards.

::

    synthetic stream of --periods periods ─► --students period directories, student i
    reading periods i .. i + --student-periods - 1 (overlapping windows share examples)
    teacher: a short run of the default synthetic config, exported (fp32 tables)
    ─► AugmentService.run(once) ─► rows/s end to end, teacher calls and their rows/s,
       duplicates served from the memo, share of time in the teacher
    ─► AugmentedPeriods: every student's periods read at --batch-size, rows/s

Writing the period files is not timed. One process, ``torch`` at ``--threads``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import Benchmark, machine_info
from towerrec.config import load_config
from towerrec.data.augmented import AugmentedPeriods
from towerrec.data.period_files import write_periods
from towerrec.data.synthetic import SyntheticSource
from towerrec.serve.export import export_run
from towerrec.workflows.distill.augment import AugmentService
from towerrec.workflows.training import train

__all__ = ["BENCHMARK"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--periods", type=int, default=4, help="periods of the stream")
    parser.add_argument("--period-samples", type=int, default=50_000, help="rows per period")
    parser.add_argument("--students", type=int, default=2, help="watched students")
    parser.add_argument("--student-periods", type=int, default=3, help="periods per student")
    parser.add_argument("--steps", type=int, default=50, help="training steps of the teacher")
    parser.add_argument("--batch-size", type=int, default=8192, help="rows per teacher call")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, help="keep the teacher, streams and shards here")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    last = args.students - 1 + args.student_periods
    if args.students < 1 or args.student_periods < 1 or last > args.periods:
        raise ValueError(
            f"--students {args.students} windows of --student-periods {args.student_periods} "
            f"need {last} periods; raise --periods to at least {last}"
        )
    torch.set_num_threads(args.threads)
    overrides = [
        f"data.synthetic.periods={args.periods}",
        f"data.synthetic.period_samples={args.period_samples}",
        "data.synthetic.eval_samples=10000",
    ]
    config = load_config(None, [*overrides, f"train.steps={args.steps}", "train.progress=false"])
    with tempfile.TemporaryDirectory(prefix="towerrec-bench-augment-") as scratch:
        root = args.out or Path(scratch)
        train(config, root / "teacher-run")
        export_run(root / "teacher-run", root / "teacher")
        source = SyntheticSource(config.data.synthetic)
        students = []
        for i in range(args.students):
            path = root / "streams" / f"s{i}"
            write_periods(source, path, range(i, i + args.student_periods))
            students.append(path)
        service = AugmentService(root / "teacher", students, root / "aug", args.batch_size)
        seconds = {"teacher": 0.0}
        logits = service.teacher.logits

        def timed(*a: Any, **k: Any) -> torch.Tensor:
            tick = time.perf_counter()
            out = logits(*a, **k)
            seconds["teacher"] += time.perf_counter() - tick
            return out

        service.teacher.logits = timed  # type: ignore[method-assign]
        tick = time.perf_counter()
        counters = service.run(once=True)
        serve_s = time.perf_counter() - tick
        tick, read_rows = time.perf_counter(), 0
        for path in students:
            reader = AugmentedPeriods(root / "aug" / path.name, timeout_s=0)
            for period in range(reader.num_periods):
                for batch in reader.period_batches(period, args.batch_size):
                    read_rows += batch.size
        read_s = time.perf_counter() - tick
    rows = counters["rows"]
    return {
        "benchmark": "augment",
        "machine": machine_info(),
        "threads": args.threads,
        "rows": rows,
        "teacher_calls": counters["teacher_calls"],
        "duplicates": counters["duplicates"],
        "shards_written": counters["shards_written"],
        "serve_s": serve_s,
        "serve_rows_per_s": rows / serve_s,
        "teacher_s": seconds["teacher"],
        "teacher_rows_per_s": counters["teacher_calls"] / max(seconds["teacher"], 1e-9),
        "teacher_share": seconds["teacher"] / serve_s,
        "teacher_calls_saved": 1 - counters["teacher_calls"] / rows,
        "read_rows": read_rows,
        "read_rows_per_s": read_rows / read_s,
    }


BENCHMARK = Benchmark(
    help="augmentation service: rows/s, teacher calls saved by the memo, student read rows/s",
    add_arguments=_add_arguments,
    run=_run,
)
