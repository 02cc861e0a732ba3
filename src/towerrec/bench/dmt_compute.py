"""``towerrec bench dmt-compute``: the compute of one rank's step, flat DLRM against DMT,
at given shapes on one device: what the DMT scale model (``planner/dmt_scale.py``)
assumes for its compute side, measured.

Per shape and precision, forward and backward (timed to their end on the device)::

    flat_dense    the flat DLRM's dense part on the rank's batch B: bottom MLP, dot
                  interaction of [x, E] (E [B, T, D], the pooled embeddings, a leaf),
                  top MLP
    tower         one tower module (models/dmt.py, ``TowerModule``) on the host's peer
                  batch H*B (B from each of the H hosts) of its T/H features
    dmt_top       DMT's top on B: interaction of [x, the H towers' K outputs], top MLP

Each gives milliseconds, FLOPs (3 x forward) and the FLOP/s achieved. ``workload`` holds
the shape in ``Workload``'s terms (``dense_flops_per_sample``, ``tower_flops_per_sample``
= H x the tower's FLOPs: one rank runs its tower on H samples for each of its own),
``measured`` the seconds and rates to calibrate ``Cluster.flops`` with, and ``limits``
the device's memory bandwidth and matmul peaks from the same run.

``--shapes FILE.json``: a list of shapes (or ``{"shapes": [...]}``), each with ``name``,
``batch_per_rank``, ``num_features``, ``embedding_dim``, ``hosts`` and optionally
``num_dense`` (13), ``bottom_mlp``, ``top_mlp``, ``tower`` (dot | fm), ``tower_outputs``
and ``tower_hidden``. The default shapes (``DEFAULT_SHAPES``) are the scale model's
default ``Workload`` at 2, 8 and 64 hosts and the MLPerf DLRM-DCNv2 shape (26 features,
dim 128) on 2 hosts; they are not the DMT paper's own configurations, which a shapes
file gives.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from towerrec.bench.common import Benchmark, comma_list, machine_info
from towerrec.bench.device_limits import measure_limits, time_per_call
from towerrec.models.dmt import TowerModule
from towerrec.modules.interaction import DotInteraction
from towerrec.modules.mlp import MLP

__all__ = ["BENCHMARK", "DEFAULT_SHAPES", "load_shapes", "measure_shape", "run_dmt_compute"]

_MLPERF_MLPS = {"bottom_mlp": [512, 256, 128], "top_mlp": [1024, 1024, 512, 256, 1]}
DEFAULT_SHAPES: list[dict[str, Any]] = [
    *(
        {
            "name": f"workload-{hosts}-hosts",
            "batch_per_rank": 1024,
            "num_features": 512,
            "embedding_dim": 128,
            "hosts": hosts,
            "tower_outputs": max(1, 512 // hosts // 4),  # compression 4
            **_MLPERF_MLPS,
        }
        for hosts in (2, 8, 64)
    ),
    {
        "name": "mlperf-dcnv2-2-hosts",
        "batch_per_rank": 8192,
        "num_features": 26,
        "embedding_dim": 128,
        "hosts": 2,
        "tower_outputs": 4,
        **_MLPERF_MLPS,
    },
]
_KEYS = {
    "name",
    "batch_per_rank",
    "num_features",
    "embedding_dim",
    "hosts",
    "num_dense",
    "bottom_mlp",
    "top_mlp",
    "tower",
    "tower_outputs",
    "tower_hidden",
}
_REQUIRED = ("name", "batch_per_rank", "num_features", "embedding_dim", "hosts")
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def check_shape(shape: dict[str, Any]) -> dict[str, Any]:
    """``shape`` with its defaults filled; a clear error for what cannot be built."""
    name = shape.get("name", "?")
    missing = [k for k in _REQUIRED if k not in shape]
    unknown = sorted(set(shape) - _KEYS)
    if missing or unknown:
        raise ValueError(
            f"shape {name!r}: "
            + (f"missing {', '.join(missing)}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown keys {', '.join(unknown)}" if unknown else "")
            + f" (a shape has {', '.join(sorted(_KEYS))})"
        )
    dim, features, hosts = shape["embedding_dim"], shape["num_features"], shape["hosts"]
    out = {
        "num_dense": 13,
        "bottom_mlp": [512, 256, dim],
        "top_mlp": [1024, 512, 256, 1],
        "tower": "dot",
        "tower_outputs": 1,
        "tower_hidden": [],
        **shape,
    }
    if out["bottom_mlp"][-1] != dim:
        raise ValueError(f"shape {name!r}: bottom_mlp must end at embedding_dim {dim}")
    if out["top_mlp"][-1] != 1:
        raise ValueError(f"shape {name!r}: top_mlp must end at 1 (the logit)")
    if hosts < 1 or features % hosts:
        raise ValueError(
            f"shape {name!r}: num_features {features} must split evenly into hosts {hosts} "
            "towers (one tower per host)"
        )
    return out


def load_shapes(path: str | Path) -> list[dict[str, Any]]:
    """The shapes of a ``--shapes`` file (module doc), checked."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--shapes {path}: cannot read a JSON list of shapes ({err})") from None
    shapes = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
        raise ValueError(f"--shapes {path}: give a JSON list of shape objects (module doc)")
    return [check_shape(s) for s in shapes]


def _timed(fn: Any, device: torch.device, repeats: int, flops: float) -> dict[str, float]:
    seconds = time_per_call(fn, device, repeats, warmup=2)
    return {
        "ms": round(seconds * 1e3, 4),
        "flops": flops,
        "tflops_achieved": round(flops / seconds / 1e12, 4),
    }


def measure_shape(
    shape: dict[str, Any], device: torch.device, dtype: torch.dtype | None, repeats: int = 10
) -> dict[str, Any]:
    """The module doc's three parts of ``shape`` (checked) on ``device``."""
    b, t, d, h = (shape[k] for k in ("batch_per_rank", "num_features", "embedding_dim", "hosts"))
    gen = torch.Generator(device=device).manual_seed(0)

    def leaf(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).requires_grad_()

    bottom = MLP(shape["num_dense"], shape["bottom_mlp"]).to(device)
    dense = torch.randn(b, shape["num_dense"], generator=gen, device=device)
    flat_dots = DotInteraction(t + 1).to(device)
    flat_top = MLP(d + flat_dots.out_features, shape["top_mlp"], final_activation=False).to(device)
    embeddings = leaf(b, t, d)
    tower = TowerModule(
        t // h, d, shape["tower"], outputs=shape["tower_outputs"], hidden=shape["tower_hidden"]
    ).to(device)
    tower_in = leaf(h * b, t // h, d)
    k = tower.num_outputs * h
    dmt_dots = DotInteraction(k + 1).to(device)
    dmt_top = MLP(d + dmt_dots.out_features, shape["top_mlp"], final_activation=False).to(device)
    tower_out = leaf(b, k, d)

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    def top_step(dots: DotInteraction, top: MLP, vectors: torch.Tensor) -> None:
        with autocast():
            x = bottom(dense)
            stacked = torch.cat([x.unsqueeze(1), vectors.to(x.dtype)], dim=1)
            logits = top(torch.cat([x, dots(stacked)], dim=1))
        logits.float().sum().backward()

    def tower_step() -> None:
        with autocast():
            out = tower(tower_in)
        out.float().sum().backward()

    bottom_flops = bottom.flops_per_sample()
    flat_fwd = bottom_flops + flat_dots.flops_per_sample(d) + flat_top.flops_per_sample()
    dmt_fwd = bottom_flops + dmt_dots.flops_per_sample(d) + dmt_top.flops_per_sample()
    parts = {
        "flat_dense": _timed(
            lambda: top_step(flat_dots, flat_top, embeddings), device, repeats, 3 * flat_fwd * b
        ),
        "tower": _timed(tower_step, device, repeats, 3 * tower.flops_per_sample() * h * b),
        "dmt_top": _timed(
            lambda: top_step(dmt_dots, dmt_top, tower_out), device, repeats, 3 * dmt_fwd * b
        ),
    }
    return {
        "workload": {
            "batch_per_rank": b,
            "num_features": t,
            "embedding_dim": d,
            "dense_flops_per_sample": 3 * flat_fwd,
            "tower_flops_per_sample": 3 * tower.flops_per_sample() * h,
            "compression": (t // h) / tower.num_outputs,
            "dense_params": sum(p.numel() for m in (bottom, flat_top) for p in m.parameters()),
        },
        "parts": parts,
        "measured": {
            "flat_step_compute_s": parts["flat_dense"]["ms"] / 1e3,
            "dmt_step_compute_s": (parts["tower"]["ms"] + parts["dmt_top"]["ms"]) / 1e3,
            "flat_tflops_achieved": parts["flat_dense"]["tflops_achieved"],
            "tower_tflops_achieved": parts["tower"]["tflops_achieved"],
        },
    }


def run_dmt_compute(
    shapes: list[dict[str, Any]],
    device: torch.device | str = "cpu",
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    repeats: int = 10,
) -> dict[str, Any]:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA device, and torch sees none")
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        raise ValueError(f"--precisions {unknown} unknown; choose from {', '.join(PRECISIONS)}")
    checked = [check_shape(s) for s in shapes]
    limits = measure_limits(device)
    rows = []
    for shape in checked:
        row: dict[str, Any] = {"shape": shape}
        for precision in precisions:
            row[precision] = measure_shape(shape, device, PRECISIONS[precision], repeats)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    return {
        "benchmark": "dmt-compute",
        "device": limits.device,
        "machine": machine_info(),
        "torch": torch.__version__,
        "limits": limits.as_dict(),
        "shapes": rows,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--shapes", default="", help="JSON file of shapes (module doc); default: DEFAULT_SHAPES"
    )
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per part")


def _run(args: argparse.Namespace) -> dict:
    shapes = load_shapes(args.shapes) if args.shapes else DEFAULT_SHAPES
    return run_dmt_compute(shapes, args.device, comma_list(args.precisions), args.repeats)


BENCHMARK = Benchmark(
    "DMT tower module and flat DLRM step compute at given shapes (for the scale model)",
    _add_arguments,
    _run,
)
