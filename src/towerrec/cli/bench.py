"""``towerrec bench NAME``: every benchmark, registered in one table.

Each benchmark module declares its arguments and returns its result as a dict
(``towerrec.bench.common.Benchmark``); this module gives each its name, adds
the flags every benchmark takes, runs the one asked for and prints its result
as one JSON object on stdout. ``--json`` is accepted, and changes nothing, for
the commands and scripts that pass it.

The table names each benchmark's module instead of importing it: a module is
imported when its benchmark is asked for (``towerrec bench NAME ...``, ``--help``
included), so that listing them (``towerrec bench --help``) imports none. The
table carries the help line that listing shows; tests/test_cli_imports.py keeps it
equal to the module's own.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from towerrec.bench.common import Benchmark

__all__ = ["BENCHMARKS", "BenchmarkEntry", "add_commands"]


@dataclass(frozen=True)
class BenchmarkEntry:
    """One benchmark of the table: its help line, and the ``Benchmark`` that
    ``module.attribute`` declares, imported on first use."""

    help: str
    module: str
    attribute: str = "BENCHMARK"

    def load(self) -> Benchmark:
        benchmark: Benchmark = getattr(importlib.import_module(self.module), self.attribute)
        return benchmark

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self.load().add_arguments(parser)

    def run(self, args: argparse.Namespace) -> dict:
        return self.load().run(args)


# `towerrec bench NAME` -> the benchmark; `towerrec bench --help` lists them in this order.
BENCHMARKS: dict[str, BenchmarkEntry] = {
    "train": BenchmarkEntry(
        "training throughput on the Criteo-Kaggle-shaped DLRM", "towerrec.bench.train"
    ),
    "embedding": BenchmarkEntry(
        "embedding lookup + backward + update alone", "towerrec.bench.embedding"
    ),
    "models": BenchmarkEntry(
        "DLRM vs DCNv2 vs Wukong at matched FLOPs per sample (planted data)",
        "towerrec.bench.zoo",
        "MODELS",
    ),
    "embeddings-memory": BenchmarkEntry(
        "AUC vs parameters: full, hash, QR and mixed-dimension tables",
        "towerrec.bench.zoo",
        "EMBEDDINGS_MEMORY",
    ),
    "optimizers": BenchmarkEntry(
        "CF-SGD vs row-wise Adagrad on the embedding tables", "towerrec.bench.zoo", "OPTIMIZERS"
    ),
    "precision": BenchmarkEntry(
        "bf16 autocast vs fp32: samples/s (Criteo shape) and AUC", "towerrec.bench.precision"
    ),
    "choice": BenchmarkEntry(
        "embedding.backend = auto against the best forced kernel", "towerrec.bench.choice"
    ),
    "data": BenchmarkEntry("Criteo TSV preprocessing and loader throughput", "towerrec.bench.data"),
    "plan": BenchmarkEntry("planners on synthetic DLRM-like table suites", "towerrec.bench.plan"),
    "costmodel": BenchmarkEntry(
        "analytic vs learned device cost on measured multi-table kernels",
        "towerrec.bench.costmodel",
    ),
    "towers": BenchmarkEntry(
        "DMT compressing towers: learned vs random vs cost-only partitions",
        "towerrec.bench.towers",
    ),
    "dmt": BenchmarkEntry(
        "flat DLRM vs DMT on 2 hosts x 2 ranks: bytes, peers, AUC, samples/s, the link's bound "
        "(--network netns: two network namespaces over a shaped link; root)",
        "towerrec.bench.dmt",
    ),
    "quality": BenchmarkEntry(
        "test AUC of towerrec's DLRM, DCNv2, Wukong vs FuxiCTR's and TorchRec's recipes in plain "
        "PyTorch (synthetic, MovieLens, Criteo-format, libFM caches; seeds, both selection rules)",
        "towerrec.bench.quality",
    ),
    "dmt-scale": BenchmarkEntry(
        "analytic step time of flat DLRM vs DMT, 16 to 512 accelerators",
        "towerrec.bench.dmt_scale",
    ),
    "dmt-compute": BenchmarkEntry(
        "DMT tower module and flat DLRM step compute at given shapes (for the scale model)",
        "towerrec.bench.dmt_compute",
    ),
    "dist": BenchmarkEntry(
        "sharded embedding steps on N CPU processes, per type", "towerrec.bench.dist_train"
    ),
    "memory": BenchmarkEntry(
        "per-rank and loader-worker memory with tables much larger than a rank's",
        "towerrec.bench.memory",
    ),
    "shampoo": BenchmarkEntry(
        "Shampoo vs Adam and Adagrad on the dense part: AUC and step time, on N processes",
        "towerrec.bench.shampoo",
    ),
    "predict": BenchmarkEntry(
        "predict throughput of an exported model and the AUC change of fp16 / int8 tables",
        "towerrec.bench.predict",
    ),
    "init": BenchmarkEntry(
        "embedding init rules and optimizers: test AUC over seeds per data set (JSON)",
        "towerrec.bench.init",
    ),
    "pu": BenchmarkEntry(
        "PU learning on MovieLens with hidden positives: naive BCE vs pu_bce (JSON)",
        "towerrec.bench.pu",
    ),
    "prune-grow": BenchmarkEntry(
        "growth and pruning against dense training (MLP FLOPs, wall-clock, test log-loss)",
        "towerrec.bench.prune_grow",
    ),
    "fsdp": BenchmarkEntry(
        "dense part under DDP vs FSDP2 (a wide Wukong): per-rank dense bytes and samples/s",
        "towerrec.bench.fsdp",
    ),
    "id-wire": BenchmarkEntry(
        "bytes per sample and time of the id wire format (int64 vs narrow vs deduplicated)",
        "towerrec.bench.id_wire",
    ),
    "locality": BenchmarkEntry(
        "exact LRU stack distances: seconds against stream length, vs the Python Fenwick sweep",
        "towerrec.bench.locality",
    ),
    "qnewton": BenchmarkEntry(
        "PB-L-BFGS and DANCE vs full-batch L-BFGS / Newton-CG and Adam: gradient evaluations, "
        "data passes",
        "towerrec.bench.qnewton",
    ),
    "nas": BenchmarkEntry(
        "DNAS: emb_dim and emb_card searches on MovieLens, mlp search on Criteo-format files, "
        "against the baseline",
        "towerrec.bench.nas",
    ),
    "tiers": BenchmarkEntry(
        "cached tables over host memory and SSD against all tables in memory (JSON)",
        "towerrec.bench.tiers",
    ),
    "row-io": BenchmarkEntry(
        "the SSD store's reads and writes of missed rows, per row, by method (JSON)",
        "towerrec.bench.row_io",
    ),
    "temporal": BenchmarkEntry(
        "next-period log-loss of batch, incremental and fgd updates on drifting (random and "
        "trend) and stationary synthetic periods",
        "towerrec.bench.temporal",
    ),
    "augment": BenchmarkEntry(
        "augmentation service: rows/s, teacher calls saved by the memo, student read rows/s",
        "towerrec.bench.augment",
    ),
    "faults": BenchmarkEntry(
        "fault injection on `train --nproc 4 --hosts 2`: kills, SIGTERM, a stall, a dropped "
        "link, a full disk, a dead loader worker; each run against an uninterrupted one",
        "towerrec.bench.faults",
    ),
    "fuzz": BenchmarkEntry(
        "Hypothesis fuzzing of every parser and file towerrec reads back: inputs tried, failures",
        "towerrec.bench.fuzz",
    ),
    "soak": BenchmarkEntry(
        "a long run (20,000 steps, a checkpoint every 200): RSS, descriptors, threads and disk "
        "sampled every 500 steps, growth after warm-up",
        "towerrec.bench.soak",
    ),
    "streaming": BenchmarkEntry(
        "ExFM students on a drifting multi-domain stream: no distillation, shared head, "
        "auxiliary head, stale teacher with and without adapter; fgd vs batch and incremental",
        "towerrec.bench.streaming",
    ),
}


class _BenchmarkParser(argparse.ArgumentParser):
    """The parser of one benchmark: the arguments its module declares join it when it
    first parses (the benchmark was asked for), not when the command line is built."""

    def __init__(self, *args: Any, entry: BenchmarkEntry, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._entry: BenchmarkEntry | None = entry

    # One signature for typeshed's three overloads (the subparsers action calls this one).
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        if self._entry is not None:
            entry, self._entry = self._entry, None
            entry.add_arguments(self)
        return super().parse_known_args(args, namespace)


def _cmd_bench(args: argparse.Namespace) -> int:
    result = BENCHMARKS[args.bench].run(args)
    print(json.dumps(result, indent=2))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_BenchmarkParser)
    for name, entry in BENCHMARKS.items():
        parser = bench_sub.add_parser(name, help=entry.help, entry=entry)
        parser.add_argument("--json", action="store_true", help="print one JSON object (always on)")
        parser.set_defaults(func=_cmd_bench)
