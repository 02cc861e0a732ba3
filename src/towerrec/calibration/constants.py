"""``calibrate``: measure this machine and fit the planner's cost constants.

Two measurements, fitted to the analytic model of planner/cost.py::

    kernel       the real EmbeddingBagCollection (one fused kernel per width) forward +
                 backward with the fused optimizer, on groups of 1..8 tables of varied
                 rows, dims and pooling factors; non-negative least squares of
                 seconds ~ kernels*k0 + tables*k1 + lookup bytes/bw_l + update bytes/bw_u
    all-to-all   2 gloo processes exchanging 4 KiB .. 8 MiB: seconds ~ latency + bytes/bw

The result is a JSON with the fitted ``constants`` (what ``CostConstants.load``
reads), the raw samples and the fit's relative error.
"""

from __future__ import annotations

import numpy as np
import torch

from towerrec.calibration.collectives import measure_all_to_all
from towerrec.calibration.kernels import FEATURES, fit_kernel, kernel_samples
from towerrec.calibration.machine import machine_info
from towerrec.planner.cost import CostConstants
from towerrec.planner.topology import PRESETS

__all__ = ["calibrate"]


def calibrate(
    num_groups: int = 24,
    batch: int = 2048,
    reps: int = 5,
    seed: int = 0,
    collectives: bool = True,
    backend: str = "auto",
    device: str = "cpu",
) -> dict:
    """Measure and fit; returns the calibration JSON (``constants`` + samples + fit error).

    ``device = "cuda"`` times the kernels on the GPU (collectives need 2 processes
    on one machine: gloo on CPU; pass ``collectives=False`` to keep the topology's links)."""
    rng = np.random.default_rng(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank, one core: and no spinning threads on a shared CPU
    try:
        samples = kernel_samples(rng, num_groups, batch, reps, backend, device)
    finally:
        torch.set_num_threads(threads)
    x = np.stack([f for f, _ in samples])
    y = np.array([s for _, s in samples])
    coef = fit_kernel(x, y)
    k0, k1, per_id, per_lookup_byte, per_row, per_update_byte = coef
    predicted = x @ coef
    kernel_error = float(np.mean(np.abs(predicted - y) / y))
    cpu = PRESETS["cpu"]
    constants = {
        "kernel_overhead_s": float(k0),
        "table_overhead_s": float(k1),
        "lookup_s_per_id": float(per_id),
        "update_s_per_row": float(per_row),
        "lookup_bandwidth": float(1 / per_lookup_byte) if per_lookup_byte > 0 else 1e15,
        "update_bandwidth": float(1 / per_update_byte) if per_update_byte > 0 else 1e15,
        "source": f"calibrated {machine_info()['date']} on {machine_info()['cpu']}",
    }
    if torch.device(device).type == "cuda":
        constants["source"] = (
            f"calibrated {machine_info()['date']} on {torch.cuda.get_device_name()} "
            f"({backend} kernel)"
        )
    result: dict = {"machine": machine_info(), "batch": batch, "device": device}
    if collectives:
        a2a = measure_all_to_all(reps=reps)
        sent = np.array([b for b, _ in a2a])
        secs = np.array([s for _, s in a2a])
        # Latency: the smallest message; bandwidth: what the largest adds on top of it.
        latency = float(secs[np.argmin(sent)])
        extra = float(secs[np.argmax(sent)]) - latency
        bandwidth = (
            float((sent.max() - sent.min()) / extra) if extra > 0 else cpu.intra_host_bandwidth
        )
        constants.update(
            collective_latency_s=float(max(latency, 0.0)),
            intra_host_bandwidth=bandwidth,
            # One machine has no second host: loopback stands for both links.
            cross_host_bandwidth=bandwidth,
        )
        result["all_to_all"] = [{"bytes": b, "seconds": s} for b, s in a2a]
    result["constants"] = {**vars(CostConstants()), **constants}
    CostConstants(**result["constants"])  # validate
    result["kernel_samples"] = [
        {
            **{name: float(value) for name, value in zip(FEATURES, f)},
            "seconds": s,
        }
        for f, s in samples
    ]
    result["kernel_fit_mean_rel_error"] = kernel_error
    return result
