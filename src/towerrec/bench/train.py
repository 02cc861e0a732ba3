"""``towerrec bench train``: single-process DLRM training throughput.

The Criteo-Kaggle shape: 13 dense features, 26 tables of 100k rows, dim 16,
bottom MLP 512-256-64-16, top MLP 512-256-1, batch 2048, one id per table,
Adam on the dense part and exact row-wise Adagrad fused into the embedding
backward. Every system trains on the same pre-generated batches in the same
process, timed round-robin (see ``time_interleaved``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from towerrec.bench.common import (
    Benchmark,
    comma_list,
    keeps_process_threads,
    machine_info,
    matmul_peak_flops,
    peak_rss_mb,
    set_threads,
    time_interleaved,
)
from towerrec.bench.device_train import PRECISIONS, run_device_train_benchmark
from towerrec.bench.torchrec_ref import (
    quiet_torchrec_logs,
    single_process_group,
    torchrec_available,
    torchrec_dlrm,
    torchrec_dlrm_fused,
    torchrec_step,
)
from towerrec.data.batch import Batch
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.kernels import Backend, fbgemm_available, resolve_backend
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.step import train_step

__all__ = [
    "BENCHMARK",
    "CRITEO_SHAPE",
    "add_timing_arguments",
    "fastest_torchrec",
    "make_batches",
    "ratios_to",
    "run_train_benchmark",
    "selected_backends",
]

CRITEO_SHAPE: dict[str, Any] = {
    "num_dense": 13,
    "num_tables": 26,
    "num_embeddings": 100_000,
    "embedding_dim": 16,
    "bottom_mlp": [512, 256, 64, 16],
    "top_mlp": [512, 256, 1],
}
EMB_LR, DENSE_LR = 0.05, 1e-3


def make_batches(shape: dict, batch_size: int, count: int = 8, seed: int = 0) -> list[Batch]:
    """``count`` random batches, one uniform id per table (features ``f0..``)."""
    gen = torch.Generator().manual_seed(seed)
    tables = shape["num_tables"]
    out = []
    for _ in range(count):
        values = torch.randint(0, shape["num_embeddings"], (tables * batch_size,), generator=gen)
        sparse = KeyedJaggedTensor(
            [f"f{i}" for i in range(tables)],
            values,
            torch.ones(tables * batch_size, dtype=torch.int64),
        )
        dense = torch.randn(batch_size, shape["num_dense"], generator=gen)
        labels = torch.randint(0, 2, (batch_size,), generator=gen).float()
        out.append(Batch(dense, sparse, labels))
    return out


def build_tables(shape: dict) -> list[TableConfig]:
    return [
        TableConfig(
            f"t{i}", shape["num_embeddings"], shape["embedding_dim"], feature_names=(f"f{i}",)
        )
        for i in range(shape["num_tables"])
    ]


def selected_backends(backends: str, results: dict) -> list[str]:
    """The backends to time; unavailable ones are recorded as skipped in ``results``."""
    chosen = []
    for backend in (b.strip() for b in backends.split(",") if b.strip()):
        if backend == "fbgemm" and not fbgemm_available():
            results["towerrec_fbgemm"] = {"skipped": "fbgemm_gpu is not installed"}
        else:
            chosen.append(backend)
    return chosen


def ratios_to(results: dict, reference: str) -> dict[str, float]:
    base = results.get(reference, {}).get("samples_per_s")
    return {
        f"{name}/{reference}": round(r["samples_per_s"] / base, 3)
        for name, r in results.items()
        if base and name != reference and "samples_per_s" in r
    }


def fastest_torchrec(results: dict, by: str = "samples_per_s") -> str:
    """The faster of TorchRec's single-device configurations (under DMP or its fused
    collection alone) by ``by``: ``samples_per_s`` (wall clock, higher is faster) or
    ``cpu_ms_per_step`` (lower is faster). Each ratio is taken against it."""
    timed = [n for n in ("torchrec", "torchrec_no_dmp") if by in results.get(n, {})]
    if by == "cpu_ms_per_step":
        return min(timed, key=lambda n: results[n][by], default="torchrec")
    return max(timed, key=lambda n: results[n][by], default="torchrec")


def cpu_ratios_to(results: dict, reference: str) -> dict[str, float]:
    """Speed-ups by CPU time per step (meaningful with one thread on a shared machine)."""
    base = results.get(reference, {}).get("cpu_ms_per_step")
    return {
        f"{name}/{reference}": round(base / r["cpu_ms_per_step"], 3)
        for name, r in results.items()
        if base and name != reference and r.get("cpu_ms_per_step")
    }


@keeps_process_threads
def run_train_benchmark(
    steps: int = 30,
    warmup: int = 5,
    backends: str = "torch,fbgemm",
    torchrec: bool = True,
    batch_size: int = 2048,
    shape: dict | None = None,
    rounds: int = 5,
    threads: int | None = None,
) -> dict:
    set_threads(threads)
    shape = dict(shape or CRITEO_SHAPE)
    batches = make_batches(shape, batch_size)
    results: dict[str, dict] = {}
    systems: dict[str, Callable[..., object]] = {}
    train_flops = 0
    for backend in selected_backends(backends, results):
        ebc = EmbeddingBagCollection(
            build_tables(shape), EmbeddingOptimizerConfig(lr=EMB_LR), backend=backend
        )
        torch.manual_seed(0)
        model = DLRM(ebc, shape["num_dense"], shape["bottom_mlp"], shape["top_mlp"])
        optimizer = torch.optim.Adam(
            [p for _, p in dense_parameters(model)], lr=DENSE_LR, fused=True
        )
        train_flops = 3 * model.flops_per_sample()  # forward + backward (2x) of the dense part
        systems[f"towerrec_{backend}"] = lambda i, m=model, o=optimizer: train_step(
            m, o, batches[i % len(batches)]
        )
    use_torchrec = torchrec and torchrec_available()
    if torchrec and not use_torchrec:
        results["torchrec"] = {"skipped": "torchrec is not installed"}
    with single_process_group() if use_torchrec else contextlib.nullcontext():
        if use_torchrec:
            quiet_torchrec_logs()
            trec_batches = [(b.dense, b.sparse.to_torchrec(), b.labels) for b in batches]
            dims = (
                shape["num_tables"],
                shape["num_embeddings"],
                shape["embedding_dim"],
                shape["num_dense"],
                shape["bottom_mlp"],
                shape["top_mlp"],
                EMB_LR,
                DENSE_LR,
            )
            for name, build in (
                ("torchrec", torchrec_dlrm),
                ("torchrec_no_dmp", torchrec_dlrm_fused),
            ):
                trec_model, trec_opt = build(*dims)
                systems[name] = lambda i, m=trec_model, o=trec_opt: torchrec_step(
                    m, o, trec_batches[i % len(trec_batches)]
                )
        # The peak before and after the timed steps, best of both: one short
        # measurement on a shared machine can land in a slow moment.
        peak = matmul_peak_flops()
        cpu_seconds: dict[str, float] = {}
        seconds = time_interleaved(
            systems, rounds, max(steps // rounds, 1), warmup, cpu_seconds=cpu_seconds
        )
        peak = max(peak, matmul_peak_flops())
        cpu_peak = matmul_peak_flops(clock=time.process_time)
    for name, s in seconds.items():
        sps = batch_size / s
        results[name] = {
            "samples_per_s": round(sps, 1),
            "step_ms": round(s * 1e3, 3),
            "matmul_peak_fraction": round(sps * train_flops / peak, 4),
            "cpu_ms_per_step": round(cpu_seconds[name] * 1e3, 3),
            "cpu_matmul_peak_fraction": round(
                batch_size * train_flops / cpu_seconds[name] / cpu_peak, 4
            ),
        }
    reference, cpu_reference = (
        fastest_torchrec(results),
        fastest_torchrec(results, "cpu_ms_per_step"),
    )
    return {
        "benchmark": "train",
        "machine": machine_info(),
        "shape": {**shape, "batch_size": batch_size},
        "steps": steps,
        "rounds": rounds,
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "cpu_matmul_peak_gflops": round(cpu_peak / 1e9, 1),
        "train_flops_per_sample": train_flops,
        "results": results,
        "torchrec_reference": reference,
        "ratios": ratios_to(results, reference),
        "cpu_torchrec_reference": cpu_reference,
        "cpu_ratios": cpu_ratios_to(results, cpu_reference),
        "default_backend": resolve_backend(Backend.AUTO, torch.device("cpu")).value,
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments ``bench train`` and ``bench embedding`` share."""
    parser.add_argument("--steps", type=int, default=30, help="timed steps per backend")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument(
        "--backends", default="torch,fbgemm", help="comma-separated kernel backends to time"
    )
    parser.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparison")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_timing_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: towerrec's step against a plain PyTorch DLRM and the step's "
        "roofline (bench/device_train.py)",
    )
    parser.add_argument(
        "--peer",
        choices=("torchrec", "plain"),
        default=None,
        help="the step's peer: TorchRec (the default on the CPU) or a plain PyTorch DLRM "
        "(the default off it; --device cpu --peer plain runs the GPU comparison's code here)",
    )
    parser.add_argument(
        "--precisions",
        default=",".join(PRECISIONS),
        help="--peer plain: comma-separated precisions to time (fp32, bf16)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="round-robin rounds")


def _run(args: argparse.Namespace) -> dict:
    if args.device != "cpu" or args.peer == "plain":
        if args.peer == "torchrec":
            raise ValueError(f"--device {args.device} compares with --peer plain, not torchrec")
        set_threads(args.threads)
        backends = "auto" if args.backends == "torch,fbgemm" else args.backends
        return run_device_train_benchmark(
            args.device,
            CRITEO_SHAPE,
            build_tables(CRITEO_SHAPE),
            make_batches(CRITEO_SHAPE, args.batch_size),
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            backends=backends,
            precisions=comma_list(args.precisions),
            lr=(EMB_LR, DENSE_LR),
        )
    return run_train_benchmark(
        steps=args.steps,
        warmup=args.warmup,
        backends=args.backends,
        torchrec=not args.no_torchrec,
        batch_size=args.batch_size,
        threads=args.threads,
        rounds=args.rounds,
    )


BENCHMARK = Benchmark("training throughput on the Criteo-Kaggle-shaped DLRM", _add_arguments, _run)
