"""``towerrec bench tiers``: training with tables larger than the fast tier.

Criteo-shaped tables (the 26 Kaggle cardinalities, the large ones scaled so that
weights plus row-wise Adagrad state come to ``--gib``), dim 64, Zipf ids from the
synthetic data set's generator, a DLRM trained on the same batches by each
variant in turn:

- ``device``: every table in memory (the reference);
- ``host``: tables with more than ``--min-rows`` rows cached (``--cache-fraction``
  of their rows in the slot table) over a full copy in host memory;
- ``ssd``: the same over row files under ``--path`` (read and written in batches by
  ``row_io`` in the output); with ``--cold`` the files' pages are dropped from the page
  cache first (``posix_fadvise``), so misses read the disk until the page cache warms;
- ``host``, ``ssd`` and ``kv`` run the defaults: the background read ahead of the next
  batch's rows and the SSD store's write-behind where the process has a core beyond its
  torch threads (``embedding.prefetch``, ``embedding.write_behind`` = ``auto``; the JSON's
  ``background`` says what each variant ran);
- ``host-sync``, ``ssd-sync``: ``host``, ``ssd`` without the background prefetch of the
  next batch's rows (``ssd-sync`` also writes its evictions back within the step: every
  transfer of the store in the step);
- ``ssd-threads``: ``ssd`` with both background threads on, whatever the cores;
- ``ssd-write-through``: ``ssd`` with the read ahead on and its evictions written back
  within the step (``embedding.write_behind = off``), the write-behind's share beside
  ``ssd-threads``;
- ``ssd-write-behind``: ``ssd`` with the write-behind on and no read ahead (its evictions'
  writes run while the lookup reads its misses), the write-behind's share beside
  ``ssd-sync``;
- ``ssd-io``: ``ssd`` with its misses read by ``pread`` / io_uring
  (``embedding.ssd_reads = io``); the other SSD variants read as ``auto`` decides (through
  the files' mapping where they fit in memory; the JSON's ``background.mapped_reads``);
- ``kv``: the same caches (each table's slots as ``host``'s) over LMDB stores of rows
  keyed by id under ``--path``, each row made from its id on first touch; nothing is
  written up front, so the store holds only the rows written back (``kv_rows_stored``,
  ``kv_store_mb``; one process only);
- ``mmap``: the page-cache-only baseline: every table in memory-mapped files under
  ``--path`` (weights and optimizer state), trained in place with no cache of rows,
  so the kernel's page cache does the caching.

``ssd`` and ``mmap`` never hold the tables in the process: the files are written with
``pwrite`` and only then mapped. Tables larger than memory run with
``--variants ssd,mmap`` (no ``device`` reference: compare with its rate at a size that
fits, and say so).

Per variant: samples/s (batch over the median step, and over the mean step),
the cache's hit rate over the timed steps, rows written back and read ahead,
the seconds to build (and initialise) the tables, and memory: the resident set
sampled after every step (``train_peak_rss_mb``; ``train_peak_anon_mb`` without the file
pages mapped, the page cache a mapped read leaves in the resident set) and the process's peak so far
(``peak_rss_mb``, which covers every variant run before; run one variant per process
to read it), each also as a fraction of the tables' bytes.
``--nproc N`` runs the same on N gloo ranks (one host): the model parallelized
with every table sharded ``--sharding`` (table-wise or row-wise; each rank caches its
own shards), each rank training its slice of every global batch of ``--batch-size``
samples. Every variant runs under the pipeline (the next batch's input_dist one step
ahead), so ``host``/``ssd`` against ``host-sync``/``ssd-sync`` is the background read
of the cached shards' misses alone; samples/s is the global batch over the slowest
rank's median (and mean) step, the cache counts are summed over the ranks, and
``ranks`` holds each rank's own.

``--device cuda`` (one process) trains on the GPU: ``device`` holds every table in
GPU memory, the cached variants hold their slot tables there over the same host or
SSD stores (the id -> slot maps beside them, ``--cache-maps``, so only missing and
evicted rows cross to and from the GPU); each step is timed to its end on the GPU
(``torch.cuda.synchronize``), batches are copied to the GPU as the trainer does, and
``gpu_peak_mb`` is each variant's peak of GPU memory allocated.

A step's time runs from the end of the one before: its batch's copy and the read ahead of the
next batch's misses (both in the batch stream) count. Each cached variant is also set against
its link-limited bound: the in-memory step plus the bytes of its missed rows per step over the
host -> device link (``link``, measured in the same run; on the CPU a copy within host memory):
``<variant>/link_bound``.

The variants run one after another (holding every layout at once would need several copies of
the tables), ``--rounds`` times in turn; each reports its best round (on a shared machine other
tenants only slow a round down; the first variant of a process is often slowed too) with every
round's samples/s beside it, and the load average at start and end belongs in the record.
``ratios_by_round`` pairs each cached variant with the in-memory run of the same round, and
``ratios_median_round`` gives their median: the best rounds' ratio can pair rounds far apart
in time, and on these machines the speed drifts between them.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from towerrec.bench.common import (
    Benchmark,
    comma_list,
    current_rss_mb,
    keeps_process_settings,
    machine_info,
    peak_rss_mb,
    set_threads,
)
from towerrec.bench.device_limits import measure_link
from towerrec.bench.tiers_data import criteo_rows, mmap_tables, tier_batches
from towerrec.build.models import build_model
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import load_config
from towerrec.data.batch import Batch, DataSchema
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.distributed.parallelize import parallelize, uniform_plan
from towerrec.modules.cached import CachedEmbeddingBagCollection
from towerrec.modules.embedding_bag import EmbeddingBagCollection, fused_embedding_modules
from towerrec.modules.interfaces import CachingCollection
from towerrec.modules.row_io import available_methods
from towerrec.modules.ssd_store import SsdStore
from towerrec.modules.tiers import Background, background_on
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.pipeline import pipelined
from towerrec.train.step import train_step

__all__ = ["BENCHMARK", "criteo_rows", "run_tiers_benchmark"]

# The background threads of each cached variant: (embedding.prefetch, embedding.write_behind).
BACKGROUND = {
    "host": (Background.AUTO, Background.AUTO),
    "ssd": (Background.AUTO, Background.AUTO),
    "kv": (Background.AUTO, Background.AUTO),
    "host-sync": (Background.OFF, Background.OFF),
    "ssd-sync": (Background.OFF, Background.OFF),
    "ssd-threads": (Background.ON, Background.ON),
    "ssd-write-through": (Background.ON, Background.OFF),
    "ssd-write-behind": (Background.OFF, Background.ON),
    "ssd-io": (Background.AUTO, Background.AUTO),
}
# How each SSD variant reads its misses (embedding.ssd_reads); the others: auto.
SSD_READS = {"ssd-io": "io"}
VARIANTS = ("device", *BACKGROUND, "mmap")
SHARDED_VARIANTS = tuple(v for v in VARIANTS if v not in ("kv", "mmap"))


def _overrides(args: argparse.Namespace, rows: list[int], variant: str, path: Path) -> list[str]:
    base = [
        f"data.synthetic.num_embeddings=[{', '.join(map(str, rows))}]",
        "data.synthetic.pooling_factors=[]",
        f"data.synthetic.zipf_alpha={args.zipf_alpha}",
        "data.synthetic.eval_samples=4096",
        f"model.embedding_dim={args.dim}",
        f"model.bottom_mlp=[128, {args.dim}]",
        "model.top_mlp=[256, 64, 1]",
        f"embedding.backend={args.backend}",
    ]
    if variant in ("device", "mmap"):
        return base
    backing = "host" if variant.startswith("host") else "kv" if variant == "kv" else "ssd"
    cached = [
        *base,
        "embedding.memory=cached",
        f"embedding.cache_fraction={args.cache_fraction}",
        f"embedding.cache_min_rows={args.min_rows}",
        f"embedding.cache_policy={args.policy}",
        f"embedding.backing={backing}",
        f"embedding.backing_path={path}",
        f"embedding.cache_maps={args.cache_maps}",
        f"embedding.prefetch={BACKGROUND[variant][0].value}",
        f"embedding.write_behind={BACKGROUND[variant][1].value}",
        f"embedding.ssd_reads={SSD_READS.get(variant, 'auto')}",
    ]
    if variant == "kv":  # each table's slots as cache_fraction gives the others
        slots = {
            f"cat_{i}": math.ceil(args.cache_fraction * n)
            for i, n in enumerate(rows)
            if n > args.min_rows
        }
        cached.append(f"embedding.cache_slots={max(slots.values(), default=1)}")
        cached += [f"embedding.tables.{t}.cache_slots={n}" for t, n in slots.items()]
    return cached


def _drop_page_cache(model: torch.nn.Module) -> None:
    for _, module in fused_embedding_modules(model):
        if isinstance(module, ShardedEmbeddingBagCollection):
            module = module.cached_shards  # this rank's shards' stores
        if isinstance(module, CachedEmbeddingBagCollection):
            for cache in module.caches.values():
                if isinstance(cache.store, SsdStore):
                    cache.store.flush()
                    fd = os.open(cache.store.path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)


def _run_variant(
    args: argparse.Namespace,
    rows: list[int],
    variant: str,
    batches: list[Batch],
    schema: DataSchema,
    path: Path,
    topology: Topology | None = None,
    device: torch.device | None = None,
) -> dict:
    """One variant's run; on a rank of ``--nproc`` (``topology``), the model sharded and
    the step times and counts this rank's (``_combine_ranks`` joins them)."""
    config = load_config(None, _overrides(args, rows, variant, path))
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    reads_ahead = variant in BACKGROUND and background_on(
        config.embedding.prefetch, "embedding.prefetch", device=device
    )
    if variant == "mmap":
        model = build_model(config, schema, torch.device("cpu"), materialize_embeddings=False)
        mmap_tables(model, path)
    elif topology is not None:
        model = build_model(config, schema, torch.device("cpu"), materialize_embeddings=False)
        mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
        sparse = model.sparse
        assert isinstance(sparse, EmbeddingBagCollection)  # build_model's, not compact
        model = parallelize(model, mesh, uniform_plan(sparse.tables, topology, args.sharding))
    else:
        model = build_model(config, schema, device)
    optimizer = build_dense_optimizer(config.optimizer, model)
    build_s = time.perf_counter() - start
    if args.cold:
        _drop_page_cache(model)
    stream: Iterator[Batch] = (b.to(device, non_blocking=True) for b in batches)
    if topology is not None:
        stream = pipelined(model, stream)  # every variant: input_dist one step ahead
        for _, module in fused_embedding_modules(model):
            if isinstance(module, ShardedEmbeddingBagCollection):
                module.prefetch_rows = reads_ahead  # the cached shards' misses read ahead
    elif reads_ahead:
        stream = pipelined(model, stream)  # read the next batch's misses ahead
    caches: list[CachingCollection] = [
        m for _, m in fused_embedding_modules(model) if isinstance(m, CachingCollection)
    ]
    times, counts, rss, anon = [], None, current_rss_mb(), current_rss_mb(anonymous=True)
    last = time.perf_counter()
    for step, batch in enumerate(stream):  # a step: its batch's arrival (and read ahead) too
        if step == args.warmup:
            counts = _counters(caches)
        train_step(model, optimizer, batch)
        if cuda:
            torch.cuda.synchronize(device)  # the step's end on the GPU
        if step >= args.warmup:
            times.append(time.perf_counter() - last)
        rss = max(rss, current_rss_mb())
        anon = max(anon, current_rss_mb(anonymous=True))
        last = time.perf_counter()
    table_mb = sum(rows) * 4 * (args.dim + 1) / 2**20
    peak = peak_rss_mb()
    out = {
        "samples_per_s": round(args.batch_size / statistics.median(times), 1),
        "background": _background(model, reads_ahead),
        "samples_per_s_mean": round(args.batch_size / statistics.mean(times), 1),
        "step_s": times,
        "build_s": round(build_s, 2),
        "train_peak_rss_mb": round(rss, 1),
        "train_peak_rss_fraction": round(rss / table_mb, 4),
        "train_peak_anon_mb": round(anon, 1),
        "train_peak_anon_fraction": round(anon / table_mb, 4),
        "peak_rss_mb": round(peak, 1),
        "peak_rss_fraction": round(peak / table_mb, 4),
    }
    if cuda:
        out["gpu_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    if caches and counts is not None:
        now = _counters(caches)
        lookups, hits = now[0] - counts[0], now[1] - counts[1]
        out.update(
            hit_rate=round(hits / lookups, 4) if lookups else None,
            lookups=lookups,
            rows_read=lookups - hits,
            rows_written_back=now[2] - counts[2],
            rows_read_ahead=now[3] - counts[3],
            bytes_read=now[4] - counts[4],
            bytes_written=now[5] - counts[5],
            missed_bytes=now[6] - counts[6],
            cached_tables=sum(len(c.cache_stats()) for c in caches),
        )
        if topology is None:
            out["cache_rows"] = sum(
                cache.cache_rows
                for c in caches
                if isinstance(c, CachedEmbeddingBagCollection)
                for cache in c.caches.values()
            )
    kv = [
        store
        for c in caches
        if isinstance(c, CachedEmbeddingBagCollection)
        for store in c.kv_stores.values()
    ]
    if kv:
        for store in kv:
            store.flush()
        out.update(
            kv_rows_stored=sum(len(store) for store in kv),
            kv_store_mb=round(
                sum((store.path / "data.mdb").stat().st_size for store in kv) / 2**20, 1
            ),
        )
    return out


def _background(model: torch.nn.Module, reads_ahead: bool) -> dict[str, bool]:
    """The background threads a variant ran: the read ahead, the SSD stores' write-behind."""
    stores = [
        cache.store
        for _, module in fused_embedding_modules(model)
        for module in [
            module.cached_shards if isinstance(module, ShardedEmbeddingBagCollection) else module
        ]
        if isinstance(module, CachedEmbeddingBagCollection)
        for cache in module.caches.values()
    ]
    out = {
        "read_ahead": reads_ahead,
        "write_behind": any(s.writes_behind for s in stores),
    }
    ssd = [s for s in stores if isinstance(s, SsdStore)]
    if ssd:
        out["mapped_reads"] = any(s.mapped_reads for s in ssd)
    return out


def _rank_part(batch: Batch, rank: int, world: int) -> Batch:
    """Samples ``[rank * b, (rank + 1) * b)`` of ``batch`` (``b = batch.size // world``)."""
    b = batch.size // world
    lo, hi = rank * b, (rank + 1) * b
    features = batch.sparse
    keys, size, offsets = features.keys(), features.stride(), features.offsets()
    spans = [(int(offsets[k * size + lo]), int(offsets[k * size + hi])) for k in range(len(keys))]
    values = features.values()
    sparse = KeyedJaggedTensor(
        keys,
        torch.cat([values[a:z] for a, z in spans]),
        features.lengths().view(len(keys), size)[:, lo:hi].reshape(-1),
        validate=False,
    )
    return Batch(batch.dense[lo:hi], sparse, batch.labels[lo:hi], validate=False)


def _rank_variants(
    topology: Topology,
    args: argparse.Namespace,
    rows: list[int],
    variants: list[str],
    path: Path,
) -> dict[str, list[dict]]:
    """One rank of ``--nproc``: every variant ``--rounds`` times, on this rank's slices."""
    set_threads(args.threads)
    world, rank = topology.world_size, topology.rank
    batches, schema = tier_batches(args, rows)
    batches = [_rank_part(b, rank, world) for b in batches]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            where = path / variant / f"rank{rank}"
            runs[variant].append(
                _run_variant(args, rows, variant, batches, schema, where, topology)
            )
            gc.collect()
            shutil.rmtree(where, ignore_errors=True)
    return runs


def _combine_ranks(args: argparse.Namespace, per_rank: list[dict]) -> dict:
    """A round of ``--nproc``: the global batch over the slowest rank's median (and mean)
    step, the cache counts summed over the ranks; each rank's own under ``ranks``."""
    out: dict = {
        "samples_per_s": round(
            args.batch_size / max(statistics.median(r["step_s"]) for r in per_rank), 1
        ),
        "samples_per_s_mean": round(
            args.batch_size / max(statistics.mean(r["step_s"]) for r in per_rank), 1
        ),
        "build_s": max(r["build_s"] for r in per_rank),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
    }
    if "lookups" in per_rank[0]:
        keys = (
            "lookups",
            "rows_read",
            "rows_written_back",
            "rows_read_ahead",
            "cached_tables",
            "bytes_read",
            "bytes_written",
            "missed_bytes",
        )
        for key in keys:
            out[key] = sum(r[key] for r in per_rank)
        lookups = out["lookups"]
        out["hit_rate"] = round(1 - out["rows_read"] / lookups, 4) if lookups else None
    out["ranks"] = [{k: v for k, v in r.items() if k != "step_s"} for r in per_rank]
    return out


def _counters(caches: list[CachingCollection]) -> tuple[int, ...]:
    stats = [s for c in caches for s in c.cache_stats().values()]
    return (
        sum(s.lookups for s in stats),
        sum(s.hits for s in stats),
        sum(s.written_back for s in stats),
        sum(s.prefetched for s in stats),
        sum(s.bytes_read for s in stats),
        sum(s.bytes_written for s in stats),
        sum(s.misses * s.record_bytes for s in stats),
    )


def link_bounds(args: argparse.Namespace, results: dict, link: dict[str, float]) -> dict:
    """Each cached variant's link-limited bound: the in-memory step plus the records of its
    missed rows per step over the host -> device link (``link``, measured); sets
    ``link_bound_samples_per_s`` on the variant, returns the ratios to it."""
    device = results.get("device", {}).get("samples_per_s")
    ratios = {}
    for name, r in results.items():
        if not device or "missed_bytes" not in r:
            continue
        read = r["missed_bytes"] / args.steps
        r["missed_bytes_per_step"] = round(read)
        r["bytes_written_per_step"] = round(r["bytes_written"] / args.steps)
        bound_s = args.batch_size / device + read / link["h2d_bytes_per_s"]
        r["link_bound_samples_per_s"] = round(args.batch_size / bound_s, 1)
        ratios[f"{name}/link_bound"] = round(r["samples_per_s"] * bound_s / args.batch_size, 3)
    return ratios


@keeps_process_settings
def run_tiers_benchmark(args: argparse.Namespace) -> dict:
    set_threads(args.threads)
    variants = [v for v in comma_list(args.variants)]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"--variants {unknown} unknown; choose from {', '.join(VARIANTS)}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device!r}: use cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA device, and torch sees none")
        if args.nproc > 1 or "mmap" in variants:
            raise ValueError(
                "--device cuda runs one process and no mmap variant (the page-cache baseline "
                "trains in host memory); drop --nproc and mmap"
            )
    if args.nproc > 1:
        other = sorted(set(variants) - set(SHARDED_VARIANTS))
        if other:
            raise ValueError(
                f"--nproc {args.nproc} runs the variants {', '.join(SHARDED_VARIANTS)}; "
                f"drop {', '.join(other)} (or run it with --nproc 1)"
            )
        if args.batch_size % args.nproc:
            raise ValueError(
                f"--batch-size {args.batch_size} is the global batch and must divide into "
                f"--nproc {args.nproc} equal slices; choose a multiple of {args.nproc}"
            )
    rows = criteo_rows(args.gib, args.dim)
    loadavg_start = os.getloadavg()
    path = Path(args.path) if args.path else Path(tempfile.mkdtemp(prefix="towerrec-tiers-"))
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        if args.nproc > 1:
            per_rank = spawn_world(
                _rank_variants, args.nproc, 1, args, rows, variants, path, timeout_s=600
            )
            for variant in variants:
                for i in range(args.rounds):
                    runs[variant].append(_combine_ranks(args, [r[variant][i] for r in per_rank]))
        else:
            batches, schema = tier_batches(args, rows)
            if device.type == "cuda":
                batches = [b.pin_memory() for b in batches]  # page-locked, as the loader's
            for _ in range(args.rounds):
                for variant in variants:
                    out = _run_variant(
                        args, rows, variant, batches, schema, path / variant, device=device
                    )
                    out.pop("step_s")
                    runs[variant].append(out)
                    gc.collect()  # the variant's tables (a cache holds cycles back to it)
                    shutil.rmtree(path / variant, ignore_errors=True)
    finally:
        if not args.path:
            shutil.rmtree(path, ignore_errors=True)
    results = {}
    for variant, outs in runs.items():
        # the best round (other tenants only ever slow a round down); every round beside it
        results[variant] = {
            **max(outs, key=lambda r: r["samples_per_s"]),
            "samples_per_s_rounds": [r["samples_per_s"] for r in outs],
        }
    ref = results.get("device", {}).get("samples_per_s")
    ratios = {
        f"{name}/device": round(r["samples_per_s"] / ref, 3)
        for name, r in results.items()
        if ref and name != "device"
    }
    if "ssd-threads" in results and "ssd-write-through" in results:  # the write-behind's share
        through = results["ssd-write-through"]["samples_per_s"]
        ratios["ssd-threads/ssd-write-through"] = round(
            results["ssd-threads"]["samples_per_s"] / through, 3
        )
    if "ssd-write-behind" in results and "ssd-sync" in results:  # the write-behind alone
        sync = results["ssd-sync"]["samples_per_s"]
        ratios["ssd-write-behind/ssd-sync"] = round(
            results["ssd-write-behind"]["samples_per_s"] / sync, 3
        )
    for name in ("host", "ssd"):  # the background read ahead against none
        if name in results and f"{name}-sync" in results:
            sync = results[f"{name}-sync"]["samples_per_s"]
            ratios[f"{name}/{name}-sync"] = round(results[name]["samples_per_s"] / sync, 3)
    link = measure_link(device)
    ratios.update(link_bounds(args, results, link))
    by_round = round_ratios({v: [r["samples_per_s"] for r in outs] for v, outs in runs.items()})
    row_bytes = 4 * (args.dim + 1)
    return {
        "benchmark": "tiers",
        "machine": machine_info(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "loadavg_start": loadavg_start,
        "loadavg": os.getloadavg(),
        "table_gib": round(sum(rows) * row_bytes / 2**30, 3),
        "tables": len(rows),
        "rows": rows,
        "dim": args.dim,
        "batch_size": args.batch_size,
        "cache_fraction": args.cache_fraction,
        "cache_min_rows": args.min_rows,
        "policy": args.policy,
        "zipf_alpha": args.zipf_alpha,
        "ids": args.ids,
        "steps": args.steps,
        "warmup": args.warmup,
        "cold": args.cold,
        "rounds": args.rounds,
        "nproc": args.nproc,
        "sharding": args.sharding if args.nproc > 1 else None,
        "row_io": available_methods()[0],
        "cache_maps": args.cache_maps,
        "link": {k: round(v / 1e9, 3) for k, v in link.items()},  # GB/s
        "results": results,
        "ratios": ratios,
        "ratios_by_round": by_round,
        "ratios_median_round": {k: round(statistics.median(v), 3) for k, v in by_round.items()},
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def round_ratios(rounds: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each cached variant's samples/s over the in-memory variant's, round by round:
    the variants of a round run one after the other, so a drift of the machine's speed
    between rounds (the best round of each variant may come from different rounds)
    cancels in these pairs. Their median sits beside the best rounds' ratio."""
    device = rounds.get("device")
    if not device:
        return {}
    return {
        f"{name}/device": [round(a / b, 3) for a, b in zip(speeds, device, strict=True)]
        for name, speeds in rounds.items()
        if name != "device"
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=0.5, help="tables' weights + state, GiB")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--cache-fraction", type=float, default=0.05)
    parser.add_argument("--min-rows", type=int, default=100_000, help="smaller tables: device")
    parser.add_argument("--policy", default="lru", choices=("lru", "lfu"))
    parser.add_argument(
        "--cache-maps",
        default="auto",
        choices=("auto", "host", "device"),
        help="where the caches' id -> slot maps run (embedding.cache_maps)",
    )
    parser.add_argument("--zipf-alpha", type=float, default=1.1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--warmup", type=int, default=30, help="steps before timing: the cache fills"
    )
    parser.add_argument("--variants", default="device,host,ssd", help=", ".join(VARIANTS))
    parser.add_argument("--backend", default="torch", choices=("auto", "torch", "fbgemm"))
    parser.add_argument("--path", default="", help="ssd, mmap: directory for the row files (temp)")
    parser.add_argument("--cold", action="store_true", help="drop the files from the page cache")
    parser.add_argument(
        "--ids",
        default="synthetic",
        choices=("synthetic", "zipf"),
        help="zipf: the large tables' ids drawn without per-row arrays (tables beyond memory)",
    )
    parser.add_argument("--seed", type=int, default=0, help="--ids zipf: the ids' seed")
    parser.add_argument("--rounds", type=int, default=1, help="run the variants N times in turn")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=1, help="gloo ranks (sharded tables)")
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda: train on the GPU (slot tables in its memory)"
    )
    parser.add_argument(
        "--sharding",
        default="table_wise",
        choices=("table_wise", "row_wise"),
        help="--nproc > 1: how every table is sharded",
    )


BENCHMARK = Benchmark(
    help="cached tables over host memory and SSD against all tables in memory (JSON)",
    add_arguments=add_arguments,
    run=run_tiers_benchmark,
)
