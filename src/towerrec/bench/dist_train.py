"""``towerrec bench dist --model dlrm``: full DLRM training steps on N CPU processes.

For each world (2 ranks on 1 host, 4 ranks standing in for 2 hosts of 2) and
each sharding type TorchRec has on CPU, three systems train the same DLRM on
the same per-rank batches in the same processes, timed round-robin:

- ``towerrec_<type>``: ``parallelize`` (sharded embeddings, DDP on the dense
  part), fp32 on the wire, no pipelining; the output all-to-all overlaps the
  bottom MLP (``DLRM.forward``);
- ``towerrec_<type>_pipelined_fp16``: the same with the next batch's
  input_dist in flight during this step (``train.pipeline``) and fp16 pooled
  embeddings and gradients on the wire;
- ``torchrec_<type>``: TorchRec 1.8's ``DLRMTrain`` under
  ``DistributedModelParallel``, driven by its ``TrainPipelineSparseDist``.

Every system: fused Adam on the dense part, exact row-wise Adagrad fused into
the embedding backward (TorchRec's data-parallel tables have no fused kernel:
its dense Adagrad updates them after DDP's all-reduce).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from towerrec.bench.common import Benchmark, machine_info, time_interleaved
from towerrec.bench.dist import ALL_TYPES, run_dist_benchmark, table_configs
from towerrec.bench.torchrec_ref import quiet_torchrec_logs, torchrec_available
from towerrec.data.batch import Batch
from towerrec.distributed.comm import Codec, CommCodecs
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.distributed.parallelize import parallelize, uniform_plan
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.optim.adam import Adam
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sharding import ShardingType
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.pipeline import pipelined
from towerrec.train.step import train_step

__all__ = ["BENCHMARK", "DIST_DLRM_SHAPE", "TORCHREC_TYPES", "run_dist_train_benchmark"]

# Data-parallel tables included: TorchRec's are stepped by a fused dense Adagrad here.
TORCHREC_TYPES = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL)

DIST_DLRM_SHAPE = {
    "num_tables": 26,
    "num_embeddings": 20_000,
    "embedding_dim": 16,
    "num_dense": 13,
    "bottom_mlp": [256, 64, 16],
    "top_mlp": [256, 128, 1],
    "batch_per_rank": 512,
}
EMB_LR, DENSE_LR = 0.05, 1e-3


def _batches(shape: dict, rank: int, count: int = 8) -> list[Batch]:
    """Per-rank batches: Criteo-like, one id per table, squared-uniform skew."""
    out = []
    tables, batch = shape["num_tables"], shape["batch_per_rank"]
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 * rank + i)
        u = torch.rand(tables * batch, generator=gen)
        sparse = KeyedJaggedTensor(
            [f"f{t}" for t in range(tables)],
            (u * u * shape["num_embeddings"]).long(),
            torch.ones(tables * batch, dtype=torch.int64),
        )
        dense = torch.randn(batch, shape["num_dense"], generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append(Batch(dense, sparse, labels))
    return out


def _towerrec_model(shape: dict, kind: str, topology: Topology, codecs: CommCodecs):
    ebc = EmbeddingBagCollection(
        table_configs(shape), EmbeddingOptimizerConfig(lr=EMB_LR), backend="auto"
    )
    torch.manual_seed(0)
    model = DLRM(ebc, shape["num_dense"], shape["bottom_mlp"], shape["top_mlp"])
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    model = parallelize(
        model, mesh, uniform_plan(table_configs(shape), topology, kind), codecs=codecs
    )
    optimizer = Adam([p for _, p in dense_parameters(model)], lr=DENSE_LR, fused=True)
    return model, optimizer


def _torchrec_pipeline(shape: dict, kind: str, world: int):
    """TorchRec's DLRMTrain under DMP and its TrainPipelineSparseDist."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner import Topology as TorchrecTopology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRM as TorchrecDLRM
    from torchrec.models.dlrm import DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    tables = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.embedding_dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names),
        )
        for t in table_configs(shape)
    ]
    torch.manual_seed(0)
    model = DLRMTrain(
        TorchrecDLRM(
            embedding_bag_collection=TorchrecEBC(tables=tables, device=torch.device("meta")),
            dense_in_features=shape["num_dense"],
            dense_arch_layer_sizes=list(shape["bottom_mlp"]),
            over_arch_layer_sizes=list(shape["top_mlp"]),
            dense_device=torch.device("cpu"),
        )
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": EMB_LR,
            "eps": 1e-8,
        }
    )
    # The same column split as ours (TorchRec's default keeps 16-wide tables whole).
    min_partition = shape["embedding_dim"] // world if kind == ShardingType.COLUMN_WISE else None
    constraints = {
        t.name: ParameterConstraints(sharding_types=[kind], min_partition=min_partition)
        for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=TorchrecTopology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    fused = set(dmp.fused_optimizer.params)
    free = {k: p for k, p in dmp.named_parameters() if k not in fused}
    tables_dp = {k: p for k, p in free.items() if "embedding_bags" in k}
    dense = {k: p for k, p in free.items() if k not in tables_dp}
    optimizers = [
        dmp.fused_optimizer,
        KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=DENSE_LR, fused=True)),
    ]
    if tables_dp:
        optimizers.append(
            KeyedOptimizerWrapper(
                tables_dp, lambda ps: torch.optim.Adagrad(ps, lr=EMB_LR, fused=True)
            )
        )
    optimizer = CombinedOptimizer(optimizers)
    return TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))


def _world(topology: Topology, shape: dict, types: list[str], torchrec: bool, steps, rounds):
    torch.set_num_threads(1)
    rank, world = topology.rank, topology.world_size
    batches = _batches(shape, rank)
    systems: dict[str, Callable[..., object]] = {}
    for kind in types:
        model, optimizer = _towerrec_model(shape, kind, topology, CommCodecs())
        systems[f"towerrec_{kind}"] = lambda i, m=model, o=optimizer: train_step(
            m, o, batches[i % len(batches)]
        )
        model, optimizer = _towerrec_model(
            shape, kind, topology, CommCodecs(Codec.FP16, Codec.FP16)
        )
        stream = pipelined(model, itertools.cycle(batches))
        systems[f"towerrec_{kind}_pipelined_fp16"] = lambda i, m=model, o=optimizer, s=stream: (
            train_step(m, o, next(s))
        )
        if torchrec and kind in TORCHREC_TYPES:
            from torchrec.datasets.utils import Batch as TorchrecBatch

            quiet_torchrec_logs()
            pipeline = _torchrec_pipeline(shape, kind, world)
            trec = itertools.cycle(
                [TorchrecBatch(b.dense, b.sparse.to_torchrec(), b.labels) for b in batches]
            )
            systems[f"torchrec_{kind}"] = lambda i, p=pipeline, it=trec: p.progress(it)
    seconds = time_interleaved(systems, rounds, max(steps // rounds, 1), warmup=3)
    global_batch = shape["batch_per_rank"] * world
    dist.barrier()
    return {
        name: {"step_ms": round(s * 1e3, 3), "samples_per_s": round(global_batch / s, 1)}
        for name, s in seconds.items()
    }


def run_dist_train_benchmark(
    nprocs: tuple[int, ...] = (2, 4),
    types: tuple[str, ...] = TORCHREC_TYPES,
    steps: int = 20,
    rounds: int = 5,
    torchrec: bool = True,
    shape: dict | None = None,
) -> dict:
    shape = dict(shape or DIST_DLRM_SHAPE)
    use_torchrec = torchrec and torchrec_available()
    worlds = {}
    for nproc in nprocs:
        hosts = 2 if nproc >= 4 and nproc % 2 == 0 else 1
        per_rank = spawn_world(
            _world,
            nproc,
            hosts,
            shape,
            list(types),
            use_torchrec,
            steps,
            rounds,
            timeout_s=900,
        )
        results = per_rank[0]
        ratios = {}
        for kind in types:
            theirs = results.get(f"torchrec_{kind}")
            for name in (f"towerrec_{kind}", f"towerrec_{kind}_pipelined_fp16"):
                if theirs and name in results:
                    ratios[name] = round(
                        results[name]["samples_per_s"] / theirs["samples_per_s"], 3
                    )
        worlds[f"{nproc}x{hosts}"] = {
            "world_size": nproc,
            "hosts": hosts,
            "results": results,
            "speedup_vs_torchrec": ratios,
        }
    return {
        "benchmark": "dist",
        "model": "dlrm",
        "machine": machine_info(),
        "shape": shape,
        "steps": steps,
        "rounds": rounds,
        "torchrec": use_torchrec or "skipped (not installed)" if torchrec else "skipped",
        "worlds": worlds,
    }


_ALL_TYPES = ",".join(t.value for t in ALL_TYPES)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", default="2,4", help="comma-separated world sizes (4: 2 hosts)")
    parser.add_argument(
        "--types",
        default=None,
        help=f"comma-separated sharding types (default: {_ALL_TYPES}; with --model dlrm: "
        "the types TorchRec has on CPU)",
    )
    parser.add_argument(
        "--model",
        choices=("embedding", "dlrm"),
        default="embedding",
        help="embedding: the sharded collection's step alone; dlrm: full DLRM training "
        "steps (pipelined input_dist, fp16 wires) against TorchRec's TrainPipelineSparseDist",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds")
    parser.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparison")


def _run(args: argparse.Namespace) -> dict:
    """``--model embedding``: bench/dist.py; ``--model dlrm``: this module."""
    nprocs = tuple(int(n) for n in args.nproc.split(","))
    if args.model == "dlrm":
        return run_dist_train_benchmark(
            nprocs=nprocs,
            types=tuple(args.types.split(",")) if args.types else TORCHREC_TYPES,
            steps=args.steps,
            rounds=args.rounds,
            torchrec=not args.no_torchrec,
        )
    return run_dist_benchmark(
        nprocs=nprocs,
        types=tuple((args.types or _ALL_TYPES).split(",")),
        steps=args.steps,
        rounds=args.rounds,
        torchrec=not args.no_torchrec,
    )


# `towerrec bench dist` is declared here rather than in bench/dist.py, which this module
# imports: one declaration for both models.
BENCHMARK = Benchmark("sharded embedding steps on N CPU processes, per type", _add_arguments, _run)
