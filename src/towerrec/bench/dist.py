"""``towerrec bench dist``: sharded embedding training steps on N CPU processes.

For each world (2 ranks on 1 host, 4 ranks standing in for 2 hosts of 2) and
each sharding type: lookup + backward + fused row-wise Adagrad update of the
sharded collection, samples/s of the global batch and the bytes every rank sent
per sample, intra- and cross-host. TorchRec 1.8's sharded collection runs in
the same processes, on the same batches, timed round-robin with ours, for the
types whose step it trains on CPU: table-wise and column-wise. Its data-parallel
tables have no fused optimizer (a separate optimizer steps them after DDP's
all-reduce, which this embedding-only step does not run), so that row would
time a step that leaves the tables unchanged and is not offered; ``bench dist
--model dlrm`` compares data-parallel tables with TorchRec's optimizer stepped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from towerrec.bench.common import machine_info, time_interleaved
from towerrec.bench.torchrec_ref import quiet_torchrec_logs, torchrec_available
from towerrec.distributed.comm import Comm
from towerrec.distributed.embedding_bag import ShardedEmbeddingBagCollection
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.distributed.parallelize import uniform_plan
from towerrec.memory import peak_rss_mb
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sharding import ShardingType
from towerrec.sparse import KeyedJaggedTensor

__all__ = ["ALL_TYPES", "DIST_SHAPE", "run_dist_benchmark"]

DIST_SHAPE = {"num_tables": 8, "num_embeddings": 20_000, "embedding_dim": 32, "batch_per_rank": 512}
TORCHREC_TYPES = (
    ShardingType.TABLE_WISE,
    ShardingType.COLUMN_WISE,
)  # see the module doc for data-parallel
# What `towerrec bench dist` times by default, in this order.
ALL_TYPES = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.TABLE_COLUMN_WISE,
    ShardingType.DATA_PARALLEL,
)


def table_configs(shape: dict) -> list[TableConfig]:
    return [
        TableConfig(f"t{i}", shape["num_embeddings"], shape["embedding_dim"], (f"f{i}",))
        for i in range(shape["num_tables"])
    ]


def _batches(shape: dict, rank: int, count: int = 8) -> list[KeyedJaggedTensor]:
    """Batches of 1..3 ids per bag, Zipf-like skew (squared uniform), per rank."""
    out = []
    tables = shape["num_tables"]
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 * rank + i)
        lengths = torch.randint(1, 4, (tables * shape["batch_per_rank"],), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen)
        values = (u * u * shape["num_embeddings"]).long()
        out.append(KeyedJaggedTensor([f"f{t}" for t in range(tables)], values, lengths))
    return out


def _torchrec_sharded(shape: dict, sharding: str, world: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
    )
    from torchrec.distributed.planner import (
        Topology as TorchrecTopology,
    )
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC

    tables = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names),
        )
        for t in table_configs(shape)
    ]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    # TorchRec cuts column-wise shards of at least 128 columns by default (so a 32-wide
    # table would stay whole); ask for the same split as ours: dim / world columns each.
    min_partition = (
        shape["embedding_dim"] // world if sharding == ShardingType.COLUMN_WISE else None
    )
    constraints = {
        t.name: ParameterConstraints(sharding_types=[sharding], min_partition=min_partition)
        for t in tables
    }
    module = TorchrecEBC(tables=tables, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=TorchrecTopology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(
        module, device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )


def _world(topology: Topology, shape: dict, types: list[str], torchrec: bool, steps, rounds):
    torch.set_num_threads(1)
    rank, world = topology.rank, topology.world_size
    batches = _batches(shape, rank)
    systems: dict[str, Callable[[int], object]]
    systems, comms = {}, {}
    for kind in types:
        ebc = EmbeddingBagCollection(
            table_configs(shape),
            EmbeddingOptimizerConfig(lr=0.05),
            backend="fbgemm",
            materialize=False,
        )
        comm = Comm(topology)
        sharded = ShardedEmbeddingBagCollection(
            ebc, uniform_plan(table_configs(shape), topology, kind), comm
        )

        def step(i: int, sharded=sharded) -> None:
            out = sharded(batches[i % len(batches)]).values()
            out.backward(torch.ones_like(out))

        systems[f"towerrec_{kind}"] = step
        comms[f"towerrec_{kind}"] = comm
        if torchrec and kind in TORCHREC_TYPES:
            quiet_torchrec_logs()
            model = _torchrec_sharded(shape, kind, world)
            trec = [b.to_torchrec() for b in batches]

            def torchrec_step(i: int, model=model, trec=trec) -> None:
                out = model(trec[i % len(trec)]).values()
                out.backward(torch.ones_like(out))

            systems[f"torchrec_{kind}"] = torchrec_step
    for comm in comms.values():
        comm.stats.reset()
    seconds = time_interleaved(systems, rounds, max(steps // rounds, 1), warmup=3)
    counted_steps = 3 + rounds * max(steps // rounds, 1)
    global_batch = shape["batch_per_rank"] * world
    results = {}
    for name, s in seconds.items():
        entry = {"step_ms": round(s * 1e3, 3), "samples_per_s": round(global_batch / s, 1)}
        if name in comms:
            totals = torch.tensor(comms[name].stats.snapshot(), dtype=torch.float64)
            dist.all_reduce(totals)
            per_sample = totals / (counted_steps * global_batch)
            entry["bytes_per_sample_intra"] = round(float(per_sample[0]), 1)
            entry["bytes_per_sample_cross"] = round(float(per_sample[1]), 1)
        results[name] = entry
    return results, peak_rss_mb()


def run_dist_benchmark(
    nprocs: tuple[int, ...] = (2, 4),
    types: tuple[str, ...] = tuple(t.value for t in ShardingType),  # type: ignore[name-defined]  # mypy bug: a generator in a default value
    steps: int = 20,
    rounds: int = 5,
    torchrec: bool = True,
) -> dict:
    use_torchrec = torchrec and torchrec_available()
    worlds = {}
    for nproc in nprocs:
        hosts = 2 if nproc >= 4 and nproc % 2 == 0 else 1
        per_rank = spawn_world(
            _world,
            nproc,
            hosts,
            DIST_SHAPE,
            list(types),
            use_torchrec,
            steps,
            rounds,
            timeout_s=600,
        )
        results = per_rank[0][0]
        peaks = [round(peak, 1) for _, peak in per_rank]
        ratios = {}
        for kind in types:
            ours, theirs = results.get(f"towerrec_{kind}"), results.get(f"torchrec_{kind}")
            if ours and theirs:
                ratios[kind] = round(ours["samples_per_s"] / theirs["samples_per_s"], 3)
        worlds[f"{nproc}x{hosts}"] = {
            "world_size": nproc,
            "hosts": hosts,
            "results": results,
            "speedup_vs_torchrec": ratios,
            # Every system of the world is alive at once (timed round-robin): the peak
            # holds all of their shards (and TorchRec's), not one system's.
            "peak_rss_mb_per_rank": peaks,
            "peak_rss_mb_max": max(peaks),
            "peak_rss_mb_sum": round(sum(peaks), 1),
        }
    return {
        "benchmark": "dist",
        "machine": machine_info(),
        "shape": DIST_SHAPE,
        "steps": steps,
        "rounds": rounds,
        "torchrec": use_torchrec or "skipped (not installed)" if torchrec else "skipped",
        "worlds": worlds,
    }
