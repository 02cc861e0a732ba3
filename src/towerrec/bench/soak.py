"""``towerrec bench soak``: a long run that must stay flat.

::

    towerrec bench soak --json                       20,000 steps, 1 process and 2 ranks
    towerrec bench soak --json --steps 2000          a smoke run

Each run is ``towerrec train`` on a generated Criteo-format cache with a
checkpoint every ``--checkpoint-every`` steps and ``train.keep_checkpoints =
--keep``. The probe (``bench/probe.py``) samples every rank every
``--sample-every`` steps: resident memory, open file descriptors, threads, and
(rank 0) the run directory's size on disk. After the warm-up (``--warmup``, a
share of the steps: the first epoch maps the cache, allocators settle) each
series gets a least-squares slope and its growth over the rest of the run in
percent of its fitted start; descriptors and threads are also reported as the
range they moved in. Targets: RSS growth under 5 %, no descriptor growth.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from towerrec.bench.common import Benchmark, add_overrides_argument, comma_list, machine_info
from towerrec.bench.fault_runs import (
    checkout_env,
    error_line,
    make_criteo_cache,
    python_train,
    read_jsonl,
    start_train,
    wait_all,
)
from towerrec.bench.probe import ProbeSpec, write_sitecustomize

__all__ = ["BENCHMARK", "growth", "run_soak"]

RSS_GROWTH_TARGET_PCT = 5.0


def growth(steps: list[int], values: list[float]) -> dict[str, float | None]:
    """A least-squares line through ``(steps, values)``: slope per 1,000 steps, and the
    change from its value at the first step to its value at the last, in percent."""
    n = len(steps)
    if n < 2:
        return {"slope_per_1k_steps": None, "growth_pct": None}
    mean_x, mean_y = sum(steps) / n, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in steps)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values)) / sxx if sxx else 0.0
    start = mean_y + slope * (steps[0] - mean_x)
    end = mean_y + slope * (steps[-1] - mean_x)
    pct = 100.0 * (end - start) / start if start else None
    return {"slope_per_1k_steps": round(slope * 1000, 4), "growth_pct": pct and round(pct, 3)}


def _series(samples: list[dict[str, Any]], after: int, key: str) -> dict[str, Any]:
    kept = [s for s in samples if s["step"] > after and key in s]
    values = [float(s[key]) for s in kept]
    if not values:
        return {}
    return {
        "first": values[0],
        "last": values[-1],
        "min": min(values),
        "max": max(values),
        **growth([s["step"] for s in kept], values),
    }


def _soak_run(
    work: Path, site: Path, nproc: int, overrides: list[str], steps: int, sample_every: int,
    warmup: int, timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    name = f"nproc{nproc}"
    run, probe_dir = work / name, work / f"{name}.probe"
    probe_dir.mkdir()
    spec = ProbeSpec(str(probe_dir), sample_every=sample_every, progress=False, disk_dir=str(run))
    flags = ["--nproc", str(nproc)] if nproc > 1 else []
    start = time.time()
    process = start_train(
        python_train(run, overrides, *flags),
        work / f"{name}.log",
        checkout_env(site, spec.environ()),
    )
    codes = wait_all([process], timeout_s)
    result: dict[str, Any] = {"nproc": nproc, "wall_s": round(time.time() - start, 1)}
    if codes != [0]:
        result["error"] = "timed out" if codes is None else error_line(work / f"{name}.log")
        return result
    result["checkpoints_left"] = sorted(p.name for p in (run / "checkpoint").iterdir())
    for rank in range(nproc):
        samples = read_jsonl(probe_dir / f"samples_rank{rank}.jsonl")
        keys = (
            ("rss_mb", "fds", "threads", "disk_mb") if rank == 0 else ("rss_mb", "fds", "threads")
        )
        result[f"rank{rank}"] = {
            "samples": len(samples),
            **{key: _series(samples, warmup, key) for key in keys},
        }
    ranks = [result[f"rank{r}"] for r in range(nproc)]
    rss = [r["rss_mb"].get("growth_pct") for r in ranks]
    fds = [r["fds"].get("max", 0) - r["fds"].get("min", 0) for r in ranks]
    result["rss_growth_pct_max"] = max((g for g in rss if g is not None), default=None)
    result["fd_growth_max"] = max(fds)
    result["flat"] = bool(
        result["rss_growth_pct_max"] is not None
        and result["rss_growth_pct_max"] < RSS_GROWTH_TARGET_PCT
        and result["fd_growth_max"] == 0
    )
    return result


def run_soak(
    steps: int = 20000,
    checkpoint_every: int = 200,
    sample_every: int = 500,
    keep: int = 2,
    nprocs: tuple[int, ...] = (1, 2),
    batch_size: int = 256,
    warmup: float = 0.2,
    overrides: tuple[str, ...] = (),
    work: Path | None = None,
    timeout_s: float = 4 * 3600,
) -> dict[str, Any]:
    if steps < 4 * sample_every or sample_every < 1:
        raise ValueError(
            f"--steps {steps} must give at least 4 samples of --sample-every {sample_every}"
        )
    if checkpoint_every < 1 or keep < 1 or not 0 <= warmup < 1:
        raise ValueError("--checkpoint-every and --keep must be >= 1, --warmup in [0, 1)")
    keep_work = work is not None
    work = Path(work or tempfile.mkdtemp(prefix="towerrec-soak-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        site = work / "site"
        write_sitecustomize(site)
        cache = make_criteo_cache(work, files=2, rows=20000, num_embeddings=5000)
        settings = [
            "data.source=criteo", f"data.path={cache}", f"train.steps={steps}",
            f"train.batch_size={batch_size}", f"train.checkpoint_every={checkpoint_every}",
            f"train.keep_checkpoints={keep}", "train.eval_every=2000", "train.log_every=500",
            "train.progress=false", "optimizer.warmup_steps=100", *overrides,
        ]  # fmt: skip
        warmup_steps = int(warmup * steps)
        runs = {
            str(n): _soak_run(work, site, n, settings, steps, sample_every, warmup_steps, timeout_s)
            for n in nprocs
        }
        return {
            "machine": machine_info(),
            "settings": {
                "steps": steps,
                "checkpoint_every": checkpoint_every,
                "sample_every": sample_every,
                "keep_checkpoints": keep,
                "batch_size": batch_size,
                "warmup_steps": warmup_steps,
                "overrides": list(overrides),
            },
            "runs": runs,
            "targets": {"rss_growth_pct_below": RSS_GROWTH_TARGET_PCT, "fd_growth": 0},
            "all_flat": all(r.get("flat") for r in runs.values()),
            "work": str(work) if keep_work else None,
        }
    finally:
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--keep", type=int, default=2, help="train.keep_checkpoints")
    parser.add_argument(
        "--nproc", type=comma_list, default=("1", "2"), help="process counts, e.g. 1,2"
    )
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=0.2, help="share of steps left out")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=4 * 3600, help="per run")
    add_overrides_argument(parser, "config override for every run")


def _run(args: argparse.Namespace) -> dict:
    try:
        nprocs = tuple(int(n) for n in args.nproc)
    except ValueError:
        raise ValueError(f"--nproc takes process counts such as 1,2; got {args.nproc}") from None
    if not nprocs or min(nprocs) < 1:
        raise ValueError(f"--nproc takes process counts >= 1, got {args.nproc}")
    return run_soak(
        args.steps, args.checkpoint_every, args.sample_every, args.keep, nprocs,
        args.batch_size, args.warmup, tuple(args.overrides), args.work, args.timeout_s,
    )  # fmt: skip


BENCHMARK = Benchmark(
    "a long run (20,000 steps, a checkpoint every 200): RSS, descriptors, threads and disk "
    "sampled every 500 steps, growth after warm-up",
    _add_arguments,
    _run,
)
