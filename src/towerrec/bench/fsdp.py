"""``towerrec bench fsdp``: the dense part replicated (DDP) or fully sharded (FSDP2).

A wide Wukong (its FM-block MLPs and top MLP hold nearly all the dense
weights) with table-wise sharded embeddings trains on N gloo ranks, once with
``distributed.dense = "ddp"`` and once with ``"fsdp"``, in the same processes
on the same per-rank batches, timed round-robin. Per rank it reports:

- dense memory between steps, counted from the tensors this rank holds
  (``distributed.fsdp.dense_memory``): weights, gradients and Adam's two
  moments; for FSDP the local pieces of the sharded ones;
- the target: FSDP's bytes at most DDP's / world plus the stated overhead, the
  uneven split of ``Shard(0)`` (the first ranks take ceil(rows / world): at most
  one row more per parameter in each of the four tensors);
- the transient cost the steady state leaves out: while a unit runs forward or
  backward its weights are all-gathered whole (``largest_unit_bytes``, the
  widest unit; the next one may be prefetched), which DDP never needs;
- samples/s (global batch over the median step time) and their ratio, and of
  ``fsdp_keep``: FSDP keeping each unit's gathered weights from forward to
  backward (``distributed.reshard_after_forward = false``), which saves the
  second all-gather.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from towerrec.bench.common import Benchmark, machine_info, time_interleaved
from towerrec.build.optimizers import build_dense_optimizer
from towerrec.config import OptimizerConfig
from towerrec.data.batch import Batch
from towerrec.distributed.fsdp import dense_memory, dense_units
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.mesh import Topology
from towerrec.distributed.parallelize import parallelize, uniform_plan
from towerrec.models.wukong import Wukong, WukongConfig
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.step import train_step

__all__ = ["BENCHMARK", "WIDE_WUKONG", "run_fsdp_benchmark"]

WIDE_WUKONG = {
    "num_tables": 8,
    "num_embeddings": 5_000,
    "embedding_dim": 32,
    "num_dense": 13,
    "num_layers": 4,
    "num_fm": 16,
    "num_lcb": 16,
    "fm_rank": 16,
    "fm_mlp": [1024, 1024],
    "top_mlp": [1024, 512, 1],
    "batch_per_rank": 128,
}


def _tables(shape: dict) -> list[TableConfig]:
    return [
        TableConfig(f"t{i}", shape["num_embeddings"], shape["embedding_dim"])
        for i in range(shape["num_tables"])
    ]


def _model(shape: dict, topology: Topology, dense: str):
    """``dense``: ``ddp``, ``fsdp``, or ``fsdp_keep`` (FSDP without resharding after
    forward: one all-gather per unit and step instead of two)."""
    ebc = EmbeddingBagCollection(_tables(shape), EmbeddingOptimizerConfig(lr=0.05), backend="auto")
    torch.manual_seed(0)
    config = WukongConfig(
        num_layers=shape["num_layers"],
        num_fm=shape["num_fm"],
        num_lcb=shape["num_lcb"],
        fm_rank=shape["fm_rank"],
        fm_mlp=tuple(shape["fm_mlp"]),
    )
    dim = shape["embedding_dim"]
    model = Wukong(ebc, shape["num_dense"], [64, dim], shape["top_mlp"], config)
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    plan = uniform_plan(_tables(shape), topology, "table_wise")
    keep = dense == "fsdp_keep"
    return parallelize(
        model, mesh, plan, dense="fsdp" if keep else dense, reshard_after_forward=not keep
    )


def _batches(shape: dict, rank: int, count: int = 4) -> list[Batch]:
    tables, batch = shape["num_tables"], shape["batch_per_rank"]
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 * rank + i)
        u = torch.rand(tables * batch, generator=gen)
        sparse = KeyedJaggedTensor(
            [f"t{t}" for t in range(tables)],
            (u * u * shape["num_embeddings"]).long(),
            torch.ones(tables * batch, dtype=torch.int64),
        )
        dense = torch.randn(batch, shape["num_dense"], generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append(Batch(dense, sparse, labels))
    return out


def _row_bytes(model) -> int:
    """Bytes of one first-dimension row of every dense parameter (fp32), summed."""
    return sum(p.numel() // max(p.shape[0], 1) * 4 for _, p in dense_parameters(model))


def _world(topology: Topology, shape: dict, steps: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    batches = _batches(shape, topology.rank)
    runs = {}
    for dense in ("ddp", "fsdp", "fsdp_keep"):
        model = _model(shape, topology, dense)
        runs[dense] = (model, build_dense_optimizer(OptimizerConfig(), model))  # Adam
    systems = {
        dense: (lambda i, m=m, o=o: train_step(m, o, batches[i % len(batches)]))
        for dense, (m, o) in runs.items()
    }
    seconds = time_interleaved(systems, rounds, max(steps // rounds, 1), warmup=2)
    global_batch = shape["batch_per_rank"] * topology.world_size
    result: dict = {"rank": topology.rank}
    for dense, (model, optimizer) in runs.items():
        memory = dense_memory(model, optimizer)  # after a step: gradients still held
        result[dense] = {
            "parameter_bytes": memory.parameters,
            "gradient_bytes": memory.gradients,
            "optimizer_state_bytes": memory.optimizer_state,
            "dense_bytes": memory.total,
            "step_ms": round(seconds[dense] * 1e3, 2),
            "samples_per_s": round(global_batch / seconds[dense], 1),
        }
    fsdp_model = runs["fsdp"][0]
    units = [*dense_units(fsdp_model)]
    result["largest_unit_bytes"] = max(
        sum(p.numel() * p.element_size() for p in u.parameters()) for u in units
    )
    result["num_units"] = len(units) + 1  # and the root
    result["overhead_bytes"] = 4 * _row_bytes(fsdp_model)  # weight, gradient, 2 moments
    result["num_dense_parameters"] = sum(p.numel() for _, p in dense_parameters(fsdp_model))
    dist.barrier()
    return result


def run_fsdp_benchmark(
    nproc: int = 2, steps: int = 10, rounds: int = 5, shape: dict | None = None
) -> dict:
    shape = {**WIDE_WUKONG, **(shape or {})}
    per_rank = spawn_world(_world, nproc, 1, shape, steps, rounds, timeout_s=900)
    ranks = []
    for r in per_rank:
        ddp, fsdp = r["ddp"]["dense_bytes"], r["fsdp"]["dense_bytes"]
        bound = ddp / nproc + r["overhead_bytes"]
        ranks.append(
            {
                **r,
                "fsdp_over_ddp_bytes": round(fsdp / ddp, 4),
                "target_bytes": int(bound),
                "target_met": fsdp <= bound,
            }
        )
    first = ranks[0]
    return {
        "benchmark": "fsdp",
        "machine": machine_info(),
        "world_size": nproc,
        "shape": shape,
        "num_dense_parameters": first["num_dense_parameters"],
        "steps": steps,
        "rounds": rounds,
        "target": "per-rank dense bytes (fsdp) <= ddp / world + overhead_bytes",
        "target_met": all(r["target_met"] for r in ranks),
        "fsdp_over_ddp_samples_per_s": round(
            first["fsdp"]["samples_per_s"] / first["ddp"]["samples_per_s"], 3
        ),
        "fsdp_keep_over_ddp_samples_per_s": round(
            first["fsdp_keep"]["samples_per_s"] / first["ddp"]["samples_per_s"], 3
        ),
        "ranks": ranks,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one host)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds")
    parser.add_argument("--layers", type=int, default=None, help="Wukong layers (default 4)")
    parser.add_argument(
        "--fm-mlp", default=None, help="comma-separated FM-block MLP widths (default 1024,1024)"
    )
    parser.add_argument("--batch", type=int, default=None, help="samples per rank (default 128)")


def _run(args: argparse.Namespace) -> dict:
    shape: dict = {}
    if args.layers is not None:
        shape["num_layers"] = args.layers
    if args.fm_mlp:
        shape["fm_mlp"] = [int(w) for w in args.fm_mlp.split(",")]
    if args.batch is not None:
        shape["batch_per_rank"] = args.batch
    return run_fsdp_benchmark(args.nproc, args.steps, args.rounds, shape)


BENCHMARK = Benchmark(
    help="dense part under DDP vs FSDP2 (a wide Wukong): per-rank dense bytes and samples/s",
    add_arguments=_add_arguments,
    run=_run,
)
