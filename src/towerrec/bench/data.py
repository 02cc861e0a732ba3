"""``towerrec bench data``: Criteo TSV preprocessing and loader throughput.

1. Generates Criteo-format files (``data/criteo_gen.py``, not timed).
2. Preprocess: ``preprocess_criteo`` on them with 1 and 2 parsing threads,
   alternating, ``rounds`` times each: MB/s of input text and rows/s (median),
   and MB per CPU-second (the process's CPU time, all threads), which other
   tenants of a shared machine do not inflate the way they inflate wall time.
3. Loader: batches of ``batch_size`` from the resulting cache, in-process and
   with worker processes, next to the single-process training step of the
   Criteo-Kaggle-shaped DLRM (``bench/train.py``) timed round-robin in the same
   run, so the ratio loader samples/s over training samples/s is measured
   under the same load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from towerrec.bench.common import Benchmark, machine_info, peak_rss_mb, time_interleaved
from towerrec.bench.train import CRITEO_SHAPE, DENSE_LR, EMB_LR, build_tables, make_batches
from towerrec.data.cache import open_cache
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.data.loader import ColumnSource, LoaderConfig
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.step import train_step

__all__ = ["BENCHMARK", "run_data_benchmark"]


def _time_preprocess(days: list[Path], work: Path, rounds: int) -> dict:
    size = sum(p.stat().st_size for p in days)
    seconds: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    rows = 0
    for r in range(rounds):
        for threads in (1, 2):
            out = work / f"cache-{threads}-{r}"
            options = CriteoOptions(num_embeddings=(100_000,), eval_fraction=0.05, threads=threads)
            start, cpu_start = time.perf_counter(), time.process_time()
            manifest = preprocess_criteo(days, out, options, progress=False)
            seconds[threads].append(time.perf_counter() - start)
            cpu[threads].append(time.process_time() - cpu_start)
            rows = sum(manifest["rows"].values())
            if r < rounds - 1 or threads == 1:
                shutil.rmtree(out)
    result = {}
    for threads, values in seconds.items():
        s = statistics.median(values)
        c = statistics.median(cpu[threads])
        result[f"threads_{threads}"] = {
            "seconds": round(s, 3),
            "mb_per_s": round(size / 1e6 / s, 1),
            "rows_per_s": round(rows / s, 1),
            "cpu_s": round(c, 3),  # CPU time of all threads of this process
            "mb_per_cpu_s": round(size / 1e6 / c, 1),
        }
    return {"input_mb": round(size / 1e6, 1), "rows": rows, **result}


def _time_workers(source: ColumnSource, batch_size: int, batches: int) -> float:
    """Seconds per batch once the workers' queues are drained (steady state)."""
    stream = source.train_batches(batch_size)
    for _ in range(2 * source.config.num_workers * source.config.prefetch):
        next(stream)
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    seconds = (time.perf_counter() - start) / batches
    stream.close()
    return seconds


def run_data_benchmark(
    rows_per_file: int = 250_000,
    files: int = 2,
    batch_size: int = 2048,
    steps: int = 20,
    rounds: int = 3,
    workers: tuple[int, ...] = (1, 2),
) -> dict:
    work = Path(tempfile.mkdtemp(prefix="towerrec-bench-data-"))
    try:
        days = generate_criteo_files(work / "raw", files, rows_per_file, seed=0)
        preprocess = _time_preprocess(days, work, rounds)
        cache = next(p for p in work.iterdir() if p.name.startswith("cache-2-"))
        store = open_cache(cache)
        source = ColumnSource(store, LoaderConfig(seed=0))

        shape = dict(CRITEO_SHAPE)
        ebc = EmbeddingBagCollection(build_tables(shape), EmbeddingOptimizerConfig(lr=EMB_LR))
        torch.manual_seed(0)
        model = DLRM(ebc, shape["num_dense"], shape["bottom_mlp"], shape["top_mlp"])
        optimizer = torch.optim.Adam([p for _, p in dense_parameters(model)], lr=DENSE_LR)
        train_batches = make_batches(shape, batch_size)
        seconds = time_interleaved(
            {
                "train_step": lambda i: train_step(
                    model, optimizer, train_batches[i % len(train_batches)]
                ),
                "loader_in_process": lambda i: source.train_batch(i, batch_size),
            },
            rounds=rounds,
            steps_per_round=max(steps // rounds, 1),
            warmup=2,
        )
        # CPU time per batch of the same two, one after the other: a shared machine's other
        # tenants stretch wall time (and a 2-thread training step most) but not CPU time.
        cpu_ms = {}
        for name, step in (
            ("train_step", lambda i: train_step(model, optimizer, train_batches[i % 8])),
            ("loader_in_process", lambda i: source.train_batch(i, batch_size)),
        ):
            start = time.process_time()
            for i in range(steps):
                step(i)
            cpu_ms[name] = round((time.process_time() - start) / steps * 1e3, 2)
        loader = {"in_process": seconds["loader_in_process"]}
        for count in workers:
            pooled = ColumnSource(store, LoaderConfig(seed=0, num_workers=count))
            loader[f"workers_{count}"] = _time_workers(pooled, batch_size, 10 * steps)
        train_sps = batch_size / seconds["train_step"]
        loader_results = {
            name: {
                "batches_per_s": round(1 / s, 1),
                "samples_per_s": round(batch_size / s, 1),
                "vs_training": round(batch_size / s / train_sps, 2),
            }
            for name, s in loader.items()
        }
        return {
            "benchmark": "data",
            "load_average": list(os.getloadavg()),
            "machine": machine_info(),
            "generated": {"files": files, "rows_per_file": rows_per_file},
            "preprocess": preprocess,
            "batch_size": batch_size,
            "training_samples_per_s": round(train_sps, 1),
            "loader": loader_results,
            "cpu_ms_per_batch": cpu_ms,
            "loader_vs_training_by_cpu_time": round(
                cpu_ms["train_step"] / cpu_ms["loader_in_process"], 2
            ),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=250_000, help="rows per generated file")
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument(
        "--steps", type=int, default=20, help="timed training steps / loader batches"
    )
    parser.add_argument("--rounds", type=int, default=3)


def _run(args: argparse.Namespace) -> dict:
    return run_data_benchmark(
        rows_per_file=args.rows,
        files=args.files,
        batch_size=args.batch_size,
        steps=args.steps,
        rounds=args.rounds,
    )


BENCHMARK = Benchmark("Criteo TSV preprocessing and loader throughput", _add_arguments, _run)
