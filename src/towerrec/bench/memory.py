"""``towerrec bench memory``: tables much larger than one process's share, measured.

Two questions, each answered by the operating system's own counters:

1. Ranks. N gloo processes train row-wise sharded tables of T bytes. Each
   rank's *model memory* is its peak resident memory minus its resident
   memory just before the model was built (imports, process group, kernel
   code: a constant). With shards that initialise themselves (what
   ``towerrec train --nproc N`` does) the model memory is about T/N and no
   rank ever holds the full tables: T / model memory ~ N. The old way (build
   the whole collection on every rank, then copy the shards out) is measured
   side by side: about T + T/N per rank, N full copies on the box at start.

2. Data-loader workers. One process holds the full tables and trains with
   ``data.loader.num_workers`` forked workers assembling batches. A forked
   worker maps the parent's pages copy-on-write: its RSS counts the tables
   although it holds no copy, so the check reads USS (pages only that process
   has) and PSS from ``/proc/<pid>/smaps_rollup``. Each training step rewrites
   table rows in the parent; without care, every page the parent rewrites
   leaves the old page to the worker alone, and over a run each worker ends up
   holding a stale copy of the tables.

The steps look up ids drawn uniformly over every row, so within a few steps
most pages of the tables are rewritten (as a long run's would be).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import time

import torch

from towerrec.bench.common import Benchmark, keeps_process_settings, machine_info
from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.distributed.parallelize import uniform_plan
from towerrec.memory import peak_rss_mb, process_memory, reset_peak_rss
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sharding import ShardingType
from towerrec.sparse import KeyedJaggedTensor

__all__ = ["BENCHMARK", "MEMORY_SHAPE", "run_memory_benchmark"]

MEMORY_SHAPE = {
    "num_tables": 4,
    "num_embeddings": 1_000_000,
    "embedding_dim": 32,
    "batch_per_rank": 512,
    "ids_per_bag": 2,
}
_MIB = 1024 * 1024


def _tables(shape: dict) -> list[TableConfig]:
    return [
        TableConfig(f"t{i}", shape["num_embeddings"], shape["embedding_dim"], (f"f{i}",))
        for i in range(shape["num_tables"])
    ]


def _table_mb(shape: dict) -> float:
    """Weights and row-wise Adagrad state of all tables."""
    rows = shape["num_tables"] * shape["num_embeddings"]
    return rows * (shape["embedding_dim"] + 1) * 4 / _MIB


def _batch(shape: dict, seed: int) -> KeyedJaggedTensor:
    tables, batch = shape["num_tables"], shape["batch_per_rank"]
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.full((tables * batch,), shape["ids_per_bag"], dtype=torch.int64)
    values = torch.randint(0, shape["num_embeddings"], (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor([f"f{t}" for t in range(tables)], values, lengths)


def _working_set_mb(shape: dict) -> float:
    """Bytes of the rows one step of one rank touches (weights + state), at most."""
    ids = shape["num_tables"] * shape["batch_per_rank"] * shape["ids_per_bag"]
    return ids * (shape["embedding_dim"] + 1) * 4 / _MIB


def _step(module, batch: KeyedJaggedTensor) -> None:
    out = module(batch).values()
    out.backward(torch.ones_like(out))


def _rank_memory(topology: Topology, shape: dict, self_init: bool, steps: int) -> dict:
    torch.set_num_threads(1)
    EmbeddingBagCollection([TableConfig("warm", 8, 8)], backend="fbgemm")  # load kernel code
    gc.collect()
    reset_peak_rss()  # count from here: start-up peaks are not the model's
    base = process_memory()["rss_mb"]
    tables = _tables(shape)
    ebc = EmbeddingBagCollection(
        tables, EmbeddingOptimizerConfig(lr=0.05), backend="fbgemm", materialize=not self_init
    )
    sharded = ShardedEmbeddingBagCollection(
        ebc, uniform_plan(tables, topology, ShardingType.ROW_WISE), Comm(topology)
    )
    del ebc
    gc.collect()
    built = peak_rss_mb()
    for i in range(steps):
        _step(sharded, _batch(shape, 1000 * topology.rank + i))
    shard_mb = sum(
        (v.weight.numel() + sum(s.numel() for s in v.state.values())) * 4 / _MIB
        for v in sharded.shard_views()
    )
    peak = peak_rss_mb()
    return {
        "base_rss_mb": round(base, 1),
        "peak_rss_mb": round(peak, 1),
        "model_mb": round(peak - base, 1),
        "model_mb_after_build": round(built - base, 1),
        "shard_mb": round(shard_mb, 1),
    }


def _ranks(shape: dict, nproc: int, steps: int) -> dict:
    table_mb = _table_mb(shape)
    out = {}
    for name, self_init in (("self_initialised", True), ("build_whole_then_shard", False)):
        per_rank = spawn_world(_rank_memory, nproc, 1, shape, self_init, steps, timeout_s=600)
        model = max(r["model_mb"] for r in per_rank)
        out[name] = {
            "per_rank": per_rank,
            "peak_rss_mb_max": max(r["peak_rss_mb"] for r in per_rank),
            "peak_rss_mb_sum": round(sum(r["peak_rss_mb"] for r in per_rank), 1),
            "model_mb_max": model,
            # How many times the tables exceed what one rank ever held for the model.
            "tables_over_rank_model": round(table_mb / model, 2),
            "tables_over_rank_peak_rss": round(
                table_mb / max(r["peak_rss_mb"] for r in per_rank), 2
            ),
        }
    return out


@keeps_process_settings
def _workers(shape: dict, workers: int, steps: int) -> dict:
    """One process with the full tables, training while ``workers`` forked loader
    workers assemble MovieLens batches; every process's RSS, PSS and USS at the end."""
    from towerrec.data.loader import ColumnSource, LoaderConfig
    from towerrec.data.movielens import bundled_movielens_path, load_movielens

    torch.set_num_threads(1)
    source = ColumnSource(
        load_movielens(bundled_movielens_path()), LoaderConfig(num_workers=workers, prefetch=2)
    )
    ebc = EmbeddingBagCollection(_tables(shape), EmbeddingOptimizerConfig(lr=0.05))
    batches = source.train_batches(256, 0, 0, 1)
    others = set(multiprocessing.active_children())
    next(batches)  # the workers are forked here, after the tables exist (as in training)
    children = [p for p in multiprocessing.active_children() if p not in others]
    for i in range(steps):
        next(batches)  # loader batches flow; the lookups touch rows all over the tables
        _step(ebc, _batch(shape, i))
    time.sleep(0.5)
    worker_memory = [{k: round(v, 1) for k, v in process_memory(p.pid).items()} for p in children]
    parent = {k: round(v, 1) for k, v in process_memory().items()}
    batches.close()
    return {
        "workers": len(children),
        "trainer": parent,
        "per_worker": worker_memory,
        "worker_uss_mb_max": max((w["uss_mb"] for w in worker_memory), default=0.0),
        "tables_mb": round(_table_mb(shape), 1),
    }


def run_memory_benchmark(
    nproc: int = 4,
    steps: int = 20,
    workers: int = 2,
    shape: dict | None = None,
) -> dict:
    shape = {**MEMORY_SHAPE, **(shape or {})}
    result = {
        "benchmark": "memory",
        "machine": machine_info(),
        "shape": shape,
        "steps": steps,
        "tables_mb": round(_table_mb(shape), 1),
        "step_working_set_mb_per_rank": round(_working_set_mb(shape), 2),
        "nproc": nproc,
    }
    if nproc:
        result["ranks"] = _ranks(shape, nproc, steps)
    if workers:
        result["loader_workers"] = _workers(shape, workers, steps)
    return result


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int, default=4, help="ranks sharing the tables row-wise (0: skip)"
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--workers", type=int, default=2, help="data-loader workers (0: skip)")
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=32)


def _run(args: argparse.Namespace) -> dict:
    for flag in ("tables", "rows", "dim", "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"bench memory: --{flag} must be >= 1, got {getattr(args, flag)}")
    if args.nproc < 0 or args.workers < 0:
        raise ValueError("bench memory: --nproc and --workers must be >= 0 (0 skips that part)")
    shape = {"num_tables": args.tables, "num_embeddings": args.rows, "embedding_dim": args.dim}
    return run_memory_benchmark(args.nproc, args.steps, args.workers, shape)


BENCHMARK = Benchmark(
    "per-rank and loader-worker memory with tables much larger than a rank's",
    _add_arguments,
    _run,
)
