"""``towerrec bench train --device cuda``: towerrec's DLRM step on an accelerator against a
plain PyTorch DLRM of the same shape (``plain_dlrm.py``), in fp32 and bf16, and against
the step's roofline from the device's limits measured in the same run
(``device_limits.py``). ``--device cpu --peer plain`` runs the same code on the CPU.

Per precision, every system trains on the same batches (already on the device), timed
round-robin with each round ended on the device (``time_interleaved``):

    towerrec_<backend>   towerrec's DLRM, embedding backend auto (the torch kernel on a
                         GPU without FBGEMM), exact row-wise Adagrad fused in backward
    plain_fused          one nn.EmbeddingBag over every table (one kernel), Adagrad
    plain_per_table      one nn.EmbeddingBag per table

The roofline is the least time a step can take on this device: the bytes it must move
at the measured memory bandwidth plus its dense FLOPs at the measured matmul rate of
its precision, phase after phase (they run one after another on one stream)::

    embedding  forward: read every looked-up row, write the pooled [B, T, D];
               backward: read the pooled gradient, read and write each distinct row
               with its optimizer state (row-wise Adagrad: D + 1 floats)
    dense      3 x forward FLOPs (forward, two backward matmuls) of the MLPs and the
               interaction, at the matmul rate of the precision
    optimizer  Adam on the dense parameters: 8 floats a parameter moved (gradient
               written, then parameter, gradient and two moments read, three written)

``roofline_fraction`` = roofline step time / measured step time (1 is the limit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from towerrec.bench.common import machine_info, time_interleaved
from towerrec.bench.device_limits import DeviceLimits, measure_limits, synchronize
from towerrec.bench.plain_dlrm import plain_dlrm, plain_step
from towerrec.data.batch import Batch
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.kernels import Backend, resolve_backend
from towerrec.modules.tables import TableConfig
from towerrec.optim.sparse import EmbeddingOptimizerConfig
from towerrec.train.step import train_step

__all__ = ["PRECISIONS", "run_device_train_benchmark", "step_roofline"]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def step_roofline(
    shape: dict[str, Any],
    batches: list[Batch],
    train_flops_per_sample: int,
    dense_params: int,
    limits: DeviceLimits,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """The step's least time on the device of ``limits`` (module doc), with its parts."""
    dim = shape["embedding_dim"]
    batch = batches[0].size
    ids = sum(b.sparse.values().numel() for b in batches) / len(batches)
    distinct = 0.0
    for b in batches:
        per_table = b.sparse.values().split(b.sparse.length_per_key())
        distinct += sum(torch.unique(v).numel() for v in per_table)
    distinct /= len(batches)
    bags = batch * shape["num_tables"]
    embedding_bytes = 4 * (ids * dim + 2 * bags * dim + distinct * 2 * (dim + 1))
    optimizer_bytes = 4 * 8 * dense_params
    flops = train_flops_per_sample * batch
    peak = limits.matmul_peak(dtype)
    parts = {
        "embedding_ms": embedding_bytes / limits.memory_bytes_per_s * 1e3,
        "dense_ms": flops / peak * 1e3,
        "optimizer_ms": optimizer_bytes / limits.memory_bytes_per_s * 1e3,
    }
    return {
        "step_ms": round(sum(parts.values()), 4),
        "parts_ms": {k: round(v, 4) for k, v in parts.items()},
        "embedding_bytes": round(embedding_bytes),
        "distinct_rows": round(distinct),
        "optimizer_bytes": optimizer_bytes,
        "train_flops": flops,
        "matmul_tflops": round(peak / 1e12, 3),
    }


def _towerrec_model(
    tables: list[TableConfig], shape: dict[str, Any], backend: str, device: torch.device, lr: tuple
) -> tuple[DLRM, torch.optim.Optimizer]:
    emb_lr, dense_lr = lr
    ebc = EmbeddingBagCollection(
        tables, EmbeddingOptimizerConfig(lr=emb_lr), backend=backend, device=device
    )
    torch.manual_seed(0)
    model = DLRM(ebc, shape["num_dense"], shape["bottom_mlp"], shape["top_mlp"]).to(device)
    optimizer = torch.optim.Adam(
        [p for _, p in dense_parameters(model)], lr=dense_lr, fused=device.type == "cuda"
    )
    return model, optimizer


def run_device_train_benchmark(
    device: torch.device | str,
    shape: dict[str, Any],
    tables: list[TableConfig],
    batches: list[Batch],
    *,
    steps: int = 30,
    warmup: int = 5,
    rounds: int = 5,
    backends: str = "auto",
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    lr: tuple[float, float] = (0.05, 1e-3),
    limits: DeviceLimits | None = None,
) -> dict[str, Any]:
    """The module doc's comparison on ``device`` for ``batches`` of ``shape``."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA device, and torch sees none")
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        raise ValueError(f"--precisions {unknown} unknown; choose from {', '.join(PRECISIONS)}")
    limits = limits or measure_limits(device)
    on_device = [b.to(device) for b in batches]
    systems: dict[str, tuple[Callable[..., Any], Any]] = {}
    train_flops, dense_params = 0, 0
    for name in (b.strip() for b in backends.split(",") if b.strip()):
        backend = resolve_backend(name, device, embedding_dims=[shape["embedding_dim"]])
        model, optimizer = _towerrec_model(tables, shape, backend.value, device, lr)
        train_flops = 3 * model.flops_per_sample()
        dense_params = sum(p.numel() for _, p in dense_parameters(model))
        systems[f"towerrec_{backend.value}"] = (train_step, (model, optimizer))
    for fused in (True, False):
        peer, optimizers = plain_dlrm(shape, device, fused, *lr)
        systems["plain_fused" if fused else "plain_per_table"] = (plain_step, (peer, optimizers))
    out: dict[str, Any] = {}
    for precision in precisions:
        dtype = PRECISIONS[precision]

        def bind(fn: Callable[..., Any], args: Any, dt: torch.dtype | None = dtype) -> Callable:
            return lambda i: fn(*args, on_device[i % len(on_device)], dt)

        seconds = time_interleaved(
            {name: bind(fn, args) for name, (fn, args) in systems.items()},
            rounds,
            max(steps // rounds, 1),
            warmup,
            sync=lambda: synchronize(device),
        )
        roofline = step_roofline(
            shape, batches, train_flops, dense_params, limits, dtype or torch.float32
        )
        results = {
            name: {
                "samples_per_s": round(on_device[0].size / s, 1),
                "step_ms": round(s * 1e3, 4),
                "roofline_fraction": round(roofline["step_ms"] / (s * 1e3), 4),
            }
            for name, s in seconds.items()
        }
        peers = [n for n in results if n.startswith("plain_")]
        reference = max(peers, key=lambda n: results[n]["samples_per_s"])
        base = results[reference]["samples_per_s"]
        out[precision] = {
            "results": results,
            "roofline": roofline,
            "plain_reference": reference,
            "ratios": {
                f"{n}/{reference}": round(r["samples_per_s"] / base, 3)
                for n, r in results.items()
                if n != reference
            },
        }
    return {
        "benchmark": "train",
        "device": limits.device,
        "machine": machine_info(),
        "torch": torch.__version__,
        "shape": {**shape, "batch_size": on_device[0].size},
        "steps": steps,
        "rounds": rounds,
        "limits": limits.as_dict(),
        "train_flops_per_sample": train_flops,
        "dense_parameters": dense_params,
        "default_backend": resolve_backend(Backend.AUTO, device).value,
        "precisions": out,
    }
