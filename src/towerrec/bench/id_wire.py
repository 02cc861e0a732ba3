"""``towerrec bench id-wire``: bytes per sample and encode/decode time of the id wire
format (``distributed/id_wire.py``) on a run's real batches.

Each of ``--batches`` training batches of ``--batch-size`` samples (one rank's local
batch) is encoded as one payload of all its sparse features, as a rank sends to a
peer that holds them all: the former int64 layout (every length and id as 8 bytes),
narrow types without deduplication, and narrow types deduplicated where smaller.
The data is the config's (``--config``, ``--set``): synthetic, MovieLens or a
Criteo-format cache, as ``towerrec train`` reads it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import Any

import torch

from towerrec.bench.common import Benchmark, add_overrides_argument, machine_info
from towerrec.build.sources import build_source
from towerrec.config import load_config
from towerrec.distributed.id_wire import IdWire

__all__ = ["BENCHMARK", "run_id_wire_benchmark"]


def run_id_wire_benchmark(
    config_path: str | None = None,
    overrides: tuple[str, ...] | list[str] = (),
    batch_size: int = 1024,
    batches: int = 8,
) -> dict[str, Any]:
    if batch_size < 1 or batches < 1:
        raise ValueError(f"--batch-size ({batch_size}) and --batches ({batches}) must be >= 1")
    config = load_config(config_path, list(overrides))
    source = build_source(config.data)
    wires = {"narrow": IdWire(False), "narrow_dedup": IdWire(True)}
    sizes: dict[str, int] = {"int64": 0, **dict.fromkeys(wires, 0)}
    encode_ms: dict[str, list[float]] = {name: [] for name in wires}
    decode_ms: dict[str, list[float]] = {name: [] for name in wires}
    samples = ids = 0
    taken = list(itertools.islice(source.train_batches(batch_size), batches))
    if not taken:
        raise ValueError("the data source gave no training batch; check data.path")
    for batch in taken:
        kjt = batch.sparse
        keys, width = len(kjt.keys()), kjt.stride()
        lengths, values = kjt.lengths().view(keys, width), kjt.values()
        samples += width
        ids += values.numel()
        sizes["int64"] += 8 * (lengths.numel() + values.numel())
        for name, wire in wires.items():
            start = time.perf_counter()
            payload = wire.encode(lengths, values)
            encode_ms[name].append(1000 * (time.perf_counter() - start))
            start = time.perf_counter()
            back_lengths, back_values = wire.decode(payload, keys, width)
            decode_ms[name].append(1000 * (time.perf_counter() - start))
            # the format is lossless
            assert torch.equal(back_lengths, lengths.long()), name
            assert torch.equal(back_values, values.long()), name
            sizes[name] += payload.numel()
    return {
        "data": config.data.source,
        "features": len(taken[0].sparse.keys()),
        "batch_size": batch_size,
        "batches": len(taken),
        "ids_per_sample": ids / samples,
        "bytes_per_sample": {name: size / samples for name, size in sizes.items()},
        "vs_int64": {name: sizes["int64"] / size for name, size in sizes.items() if size},
        "encode_ms_median": {n: statistics.median(v) for n, v in encode_ms.items()},
        "decode_ms_median": {n: statistics.median(v) for n, v in decode_ms.items()},
        "machine": machine_info(),
        "load_average": list(os.getloadavg()),
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a TOML config (the data section is read)")
    parser.add_argument("--batch-size", type=int, default=1024, help="one rank's local batch")
    parser.add_argument("--batches", type=int, default=8)
    add_overrides_argument(parser, "config override (data.path=..., ...)")


def _run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return run_id_wire_benchmark(args.config, args.overrides, args.batch_size, args.batches)


BENCHMARK = Benchmark(
    "bytes per sample and time of the id wire format (int64 vs narrow vs deduplicated)",
    _add_arguments,
    _run,
)
