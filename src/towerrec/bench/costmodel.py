"""``towerrec bench costmodel``: how well do the cost models predict measured device time?

Random devices (1..8 tables of varied rows, dims, pooling and skew) run through
the real EmbeddingBagCollection (forward + backward + fused update, one
thread); a random 75% trains both the calibrated analytic model (its constants
fitted by non-negative least squares, towerrec.calibration) and the learned model
(planner/learned_cost.py); both predict the held-out 25%. Reports mean and
median relative error on the held-out devices.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from towerrec.bench.common import Benchmark
from towerrec.calibration import (
    fit_kernel,
    kernel_features,
    machine_info,
    measure_device,
    random_device,
)
from towerrec.planner.learned_cost import LearnedCostModel
from towerrec.planner.stats import TableStats

__all__ = ["BENCHMARK", "collect_device_samples", "run_costmodel_benchmark"]


def collect_device_samples(num_devices: int, batch: int, reps: int = 5, seed: int = 0):
    """``num_devices`` random devices and their measured seconds (one thread)."""
    rng = np.random.default_rng([seed, 17])
    devices, seconds = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for d in range(num_devices):
            shards = random_device(rng, f"d{d}")
            devices.append(shards)
            seconds.append(measure_device(shards, batch, reps, seed=d))
    finally:
        torch.set_num_threads(threads)
    return devices, seconds


def _to_json(devices, seconds) -> list[dict]:
    return [
        {"shards": [{**vars(s), "rows": r, "cols": c} for s, r, c in shards], "seconds": t}
        for shards, t in zip(devices, seconds)
    ]


def _from_json(data: list[dict]):
    devices, seconds = [], []
    for entry in data:
        shards = []
        for sh in entry["shards"]:
            sh = dict(sh)
            rows, cols = sh.pop("rows"), sh.pop("cols")
            sh["feature_names"] = tuple(sh.get("feature_names", ()))
            shards.append((TableStats(**sh), rows, cols))
        devices.append(shards)
        seconds.append(entry["seconds"])
    return devices, seconds


def _errors(predicted, measured) -> dict:
    rel = np.abs(np.asarray(predicted) - np.asarray(measured)) / np.asarray(measured)
    return {"mean_rel_error": float(rel.mean()), "median_rel_error": float(np.median(rel))}


def run_costmodel_benchmark(
    num_devices: int = 200,
    batch: int = 2048,
    samples_in: str | None = None,
    samples_out: str | None = None,
    seed: int = 0,
) -> dict:
    if samples_in:
        devices, seconds = _from_json(json.loads(Path(samples_in).read_text()))
    else:
        devices, seconds = collect_device_samples(num_devices, batch, seed=seed)
    if samples_out:
        Path(samples_out).write_text(json.dumps(_to_json(devices, seconds)) + "\n")
    order = np.random.default_rng([seed, 3]).permutation(len(devices))
    cut = int(0.75 * len(devices))
    train, test = order[:cut], order[cut:]
    y = np.asarray(seconds)
    x = np.stack([kernel_features(d, batch) for d in devices])
    coef = fit_kernel(x[train], y[train])
    learned = LearnedCostModel(batch=batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny network: more threads only spin on a shared CPU
    try:
        loss = learned.fit([devices[i] for i in train], y[train].tolist())
        predicted = learned.predict([devices[i] for i in test])
    finally:
        torch.set_num_threads(threads)
    sizes = [len(devices[i]) for i in test]
    multi = [k for k, s in enumerate(sizes) if s > 1]
    analytic = x[test] @ coef
    return {
        "benchmark": "costmodel",
        "machine": machine_info(),
        "devices": {"train": len(train), "held_out": len(test), "batch": batch},
        "analytic_calibrated": {
            **_errors(analytic, y[test]),
            "multi_table_only": _errors(analytic[multi], y[test][multi]),
        },
        "learned": {
            **_errors(predicted, y[test]),
            "multi_table_only": _errors(np.asarray(predicted)[multi], y[test][multi]),
            "train_mse_log": loss,
        },
        "analytic_constants": dict(
            zip(
                (
                    "kernel_s",
                    "shard_s",
                    "s_per_id",
                    "s_per_lookup_byte",
                    "s_per_row",
                    "s_per_update_byte",
                ),
                coef.tolist(),
            )
        ),
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=200, help="random devices to measure")
    parser.add_argument("--samples", help="reuse measured devices from this JSON, measure nothing")
    parser.add_argument("--save-samples", help="write the measured devices as JSON")


def _run(args: argparse.Namespace) -> dict:
    return run_costmodel_benchmark(
        num_devices=args.devices, samples_in=args.samples, samples_out=args.save_samples
    )


BENCHMARK = Benchmark(
    "analytic vs learned device cost on measured multi-table kernels", _add_arguments, _run
)
