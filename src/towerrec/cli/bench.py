"""``towerrec bench NAME``: every benchmark, registered in one table.

Each benchmark module declares its arguments and returns its result as a dict
(``towerrec.bench.common.Benchmark``); this module gives each its name, adds
the flags every benchmark takes, runs the one asked for and prints its result
as one JSON object on stdout. ``--json`` is accepted, and changes nothing, for
the commands and scripts that pass it.
"""

from __future__ import annotations

import argparse
import json

from towerrec.bench import (
    augment,
    costmodel,
    data,
    dist_train,
    dmt,
    dmt_scale,
    embedding,
    fsdp,
    id_wire,
    locality,
    memory,
    nas,
    plan,
    predict,
    prune_grow,
    pu,
    qnewton,
    quality,
    shampoo,
    streaming,
    temporal,
    tiers,
    towers,
    train,
    zoo,
)
from towerrec.bench.common import Benchmark

__all__ = ["BENCHMARKS", "add_commands"]

# `towerrec bench NAME` -> the benchmark; `towerrec bench --help` lists them in this order.
BENCHMARKS: dict[str, Benchmark] = {
    "train": train.BENCHMARK,
    "embedding": embedding.BENCHMARK,
    "models": zoo.MODELS,
    "embeddings-memory": zoo.EMBEDDINGS_MEMORY,
    "optimizers": zoo.OPTIMIZERS,
    "precision": zoo.PRECISION,
    "data": data.BENCHMARK,
    "plan": plan.BENCHMARK,
    "costmodel": costmodel.BENCHMARK,
    "towers": towers.BENCHMARK,
    "dmt": dmt.BENCHMARK,
    "quality": quality.BENCHMARK,
    "dmt-scale": dmt_scale.BENCHMARK,
    "dist": dist_train.BENCHMARK,
    "memory": memory.BENCHMARK,
    "shampoo": shampoo.BENCHMARK,
    "predict": predict.BENCHMARK,
    "pu": pu.BENCHMARK,
    "prune-grow": prune_grow.BENCHMARK,
    "fsdp": fsdp.BENCHMARK,
    "id-wire": id_wire.BENCHMARK,
    "locality": locality.BENCHMARK,
    "qnewton": qnewton.BENCHMARK,
    "nas": nas.BENCHMARK,
    "tiers": tiers.BENCHMARK,
    "temporal": temporal.BENCHMARK,
    "augment": augment.BENCHMARK,
    "streaming": streaming.BENCHMARK,
}


def _cmd_bench(args: argparse.Namespace) -> int:
    result = BENCHMARKS[args.bench].run(args)
    print(json.dumps(result, indent=2))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, benchmark in BENCHMARKS.items():
        parser = bench_sub.add_parser(name, help=benchmark.help)
        parser.add_argument("--json", action="store_true", help="print one JSON object (always on)")
        benchmark.add_arguments(parser)
        parser.set_defaults(func=_cmd_bench)
