"""``towerrec bench embedding``: the embedding lookup + backward + fused update alone.

26 tables of 100k rows, dim 64, batch 2048, one id per table, exact row-wise
Adagrad; each backend and TorchRec (if installed) both ways it runs on one
device, under DMP and its fused collection alone, run the same batches; ratios
are against the faster TorchRec.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import torch

from towerrec.bench.common import (
    Benchmark,
    keeps_process_settings,
    machine_info,
    peak_rss_mb,
    set_threads,
    time_interleaved,
)
from towerrec.bench.torchrec_ref import (
    quiet_torchrec_logs,
    single_process_group,
    torchrec_available,
    torchrec_fused_collection,
    torchrec_tables,
)
from towerrec.bench.train import (
    add_timing_arguments,
    build_tables,
    make_batches,
    selected_backends,
)
from towerrec.bench.train_report import fastest_torchrec, ratios_to
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.optim.sparse import EmbeddingOptimizerConfig

__all__ = ["BENCHMARK", "EMBEDDING_SHAPE", "run_embedding_benchmark"]

EMBEDDING_SHAPE = {"num_tables": 26, "num_embeddings": 100_000, "embedding_dim": 64, "num_dense": 1}
BATCH = 2048


def _torchrec_tables(shape: dict) -> list:
    return torchrec_tables(shape["num_tables"], shape["num_embeddings"], shape["embedding_dim"])


def _torchrec_ebc(shape: dict):
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC

    tables = _torchrec_tables(shape)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    constraints = {
        t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for t in tables
    }
    module = TorchrecEBC(tables=tables, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(
        module, device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )


@keeps_process_settings
def run_embedding_benchmark(
    steps: int = 30,
    warmup: int = 5,
    backends: str = "torch,fbgemm",
    torchrec: bool = True,
    rounds: int = 5,
    threads: int | None = None,
) -> dict:
    set_threads(threads)
    shape = dict(EMBEDDING_SHAPE)
    batches = make_batches(shape, BATCH)
    results: dict[str, dict] = {}
    systems: dict[str, Callable[[int], None]] = {}
    for backend in selected_backends(backends, results):
        ebc = EmbeddingBagCollection(
            build_tables(shape), EmbeddingOptimizerConfig(lr=0.05), backend=backend
        )

        def step(i: int, ebc=ebc) -> None:
            out = ebc(batches[i % len(batches)].sparse).values()
            out.backward(torch.ones_like(out))

        systems[f"towerrec_{backend}"] = step
    use_torchrec = torchrec and torchrec_available()
    if torchrec and not use_torchrec:
        results["torchrec"] = {"skipped": "torchrec is not installed"}
    with single_process_group() if use_torchrec else contextlib.nullcontext():
        if use_torchrec:
            quiet_torchrec_logs()
            model = _torchrec_ebc(shape)
            trec = [b.sparse.to_torchrec() for b in batches]

            def torchrec_step(i: int) -> None:
                out = model(trec[i % len(trec)]).values()
                out.backward(torch.ones_like(out))

            systems["torchrec"] = torchrec_step
            fused = torchrec_fused_collection(_torchrec_tables(shape), 0.05)

            def torchrec_fused_step(i: int) -> None:
                out = fused(trec[i % len(trec)]).values()
                out.backward(torch.ones_like(out))

            systems["torchrec_no_dmp"] = torchrec_fused_step
        seconds = time_interleaved(systems, rounds, max(steps // rounds, 1), warmup)
    for name, s in seconds.items():
        results[name] = {"step_ms": round(s * 1e3, 3), "samples_per_s": round(BATCH / s, 1)}
    return {
        "benchmark": "embedding",
        "machine": machine_info(),
        "shape": {**shape, "batch_size": BATCH},
        "steps": steps,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "results": results,
        "torchrec_reference": (reference := fastest_torchrec(results)),
        "ratios": ratios_to(results, reference),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def _run(args: argparse.Namespace) -> dict:
    return run_embedding_benchmark(
        steps=args.steps,
        warmup=args.warmup,
        backends=args.backends,
        torchrec=not args.no_torchrec,
        threads=args.threads,
    )


BENCHMARK = Benchmark("embedding lookup + backward + update alone", add_timing_arguments, _run)
