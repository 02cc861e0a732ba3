"""``towerrec bench faults``: what a multi-host training run survives.

::

    towerrec data gen-criteo + towerrec data criteo     a Criteo-format cache
    reference:  towerrec train --nproc 4 --hosts 2      uninterrupted
    each case:  the same run, one fault injected        (bench/fault_cases.py)
                (--max-restarts K: elastic restarts resume from the last checkpoint)

Per case: whether the run completed or ended in a clear error (the CLI's one
``error:`` line) with its last checkpoint intact; whether its final state (the
last checkpoint's weights and optimizer states, loaded into one fresh process)
equals the reference run's bit for bit (else the largest difference); the step
it resumed from and how many steps it trained again; seconds from the fault to
the first step after it (``restart_s``) and to the first step past the one the
fault hit (``recovery_s``). Timing columns want an idle machine; the others do not.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.bench.fault_cases import CASES, FaultBench, FaultSettings
from towerrec.bench.fault_runs import error_line, final_state, make_criteo_cache
from towerrec.bench.probe import write_sitecustomize

__all__ = ["BENCHMARK", "run_faults"]


def run_faults(
    settings: FaultSettings,
    cases: tuple[str, ...] = tuple(CASES),
    work: Path | None = None,
    files: int = 2,
    rows: int = 20000,
    num_embeddings: int = 5000,
) -> dict[str, Any]:
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ValueError(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    keep = work is not None
    work = Path(work or tempfile.mkdtemp(prefix="towerrec-faults-")).resolve()
    if keep and work.exists() and any(work.iterdir()):
        raise FileExistsError(f"--work {work} is not empty; give a new directory")
    work.mkdir(parents=True, exist_ok=True)
    try:
        bench = FaultBench(
            settings,
            work,
            make_criteo_cache(work, files, rows, num_embeddings),
            work / "site",
            random.Random(settings.seed),
        )
        write_sitecustomize(bench.site)
        start = time.time()
        run, codes = bench.run_local("reference", None)
        if codes != [0]:
            raise RuntimeError(f"the reference run failed: {error_line(work / 'reference.log')}")
        bench.reference = final_state(run)
        result: dict[str, Any] = {
            "machine": machine_info(),
            "settings": {**settings.__dict__, "files": files, "rows_per_file": rows},
            "reference_s": round(time.time() - start, 1),
            "cases": {},
        }
        for name in cases:
            start = time.time()
            row = CASES[name](bench)
            row["wall_s"] = round(time.time() - start, 1)
            result["cases"][name] = row
            print(f"{name}: {row.get('outcome')} ok={row.get('ok')}", file=sys.stderr)
        result["all_ok"] = all(
            r.get("ok") for r in result["cases"].values() if r.get("outcome") != "skipped"
        )
        result["work"] = str(work) if keep else None
        return result
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases", type=comma_list, default=tuple(CASES), help=f"of {','.join(CASES)}"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the faults' ranks and steps")
    parser.add_argument("--files", type=int, default=2, help="generated Criteo files")
    parser.add_argument("--rows", type=int, default=20000, help="rows per generated file")
    parser.add_argument("--num-embeddings", type=int, default=5000, help="rows per table")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run: a hang")
    parser.add_argument(
        "--stall-timeout-s", type=float, default=30.0, help="distributed.timeout_s of `stall`"
    )
    parser.add_argument("--link-down-s", type=float, default=30.0)
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temp dir)")
    add_overrides_argument(parser, "config override for every run")


def _run(args: argparse.Namespace) -> dict:
    settings = FaultSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        nproc=args.nproc,
        hosts=args.hosts,
        max_restarts=args.max_restarts,
        seed=args.seed,
        timeout_s=args.timeout_s,
        stall_timeout_s=args.stall_timeout_s,
        link_down_s=args.link_down_s,
        overrides=tuple(args.overrides),
    )
    return run_faults(settings, args.cases, args.work, args.files, args.rows, args.num_embeddings)


BENCHMARK = Benchmark(
    "fault injection on `train --nproc 4 --hosts 2`: kills, SIGTERM, a stall, a dropped "
    "link, a full disk, a dead loader worker; each run against an uninterrupted one",
    _add_arguments,
    _run,
)
