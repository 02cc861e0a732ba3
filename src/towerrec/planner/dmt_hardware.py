"""The DMT paper's hardware as the scale model's constants, every one with its source.

Luo et al., "Disaggregated Multi-Tower: Topology-aware Modeling Technique for Efficient
Large Scale Recommendation", MLSys 2024 (arXiv 2403.00877), trains on hosts of 8 GPUs
joined by NVLink inside a host and RDMA (RoCE) NICs across hosts, over three GPU
generations (V100, A100, H100) and 16 to 512 GPUs. Per GPU, each constant below is a
vendor's published peak (``SPECS``) or an assumption named as one (``ASSUMED``):

- peak dense tensor FLOP/s (fp16/bf16, no sparsity) and HBM bandwidth: the GPU's
  datasheet;
- NVLink bandwidth per GPU, each direction: half the datasheet's bidirectional total;
- NIC bandwidth per GPU, each direction: the reference 8-GPU system's NICs over its 8
  GPUs (DGX-1 V100: 4 x 100 Gb/s EDR; DGX A100: 8 x 200 Gb/s HDR; DGX H100: 8 x 400
  Gb/s NDR). The paper's own hosts are Meta's; that their NICs per GPU match these is
  the first assumption below.

``cluster_for`` turns one generation into the scale model's ``Cluster`` (achieved =
peak x an efficiency). ``measured_efficiency`` replaces the assumed dense efficiency by
one measured on a GPU (``towerrec bench train --device cuda --shapes``'s JSON, when a
GPU machine ran it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from towerrec.planner.dmt_scale import Cluster, Workload, predict_step

__all__ = [
    "ASSUMED",
    "PAPER",
    "PAPER_REPORTED",
    "SPECS",
    "Accelerator",
    "cluster_for",
    "compare_with_paper",
    "explain_gap",
    "measured_efficiency",
]


@dataclass(frozen=True)
class Accelerator:
    """Published peaks of one GPU in an 8-GPU host (bytes/s are per direction)."""

    name: str
    peak_flops: float  # dense fp16/bf16 tensor FLOP/s
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s per GPU, each direction
    nic_bw: float  # bytes/s per GPU, each direction
    sources: tuple[tuple[str, str], ...]  # (constant, where it is published)


_GB, _T = 1e9, 1e12
SPECS: dict[str, Accelerator] = {
    "v100": Accelerator(
        "NVIDIA V100 SXM2 (DGX-1)",
        125 * _T,
        900 * _GB,
        150 * _GB,
        4 * 100e9 / 8 / 8,
        (
            ("peak_flops", "NVIDIA Tesla V100 datasheet: 125 TFLOPS tensor (SXM2)"),
            ("hbm_bw", "NVIDIA Tesla V100 datasheet: HBM2 900 GB/s"),
            ("nvlink_bw", "NVIDIA Tesla V100 datasheet: NVLink 300 GB/s (both directions)"),
            ("nic_bw", "NVIDIA DGX-1 datasheet: 4 x 100 Gb/s EDR InfiniBand for 8 GPUs"),
        ),
    ),
    "a100": Accelerator(
        "NVIDIA A100 SXM4 40 GB (DGX A100)",
        312 * _T,
        1555 * _GB,
        300 * _GB,
        200e9 / 8,
        (
            ("peak_flops", "NVIDIA A100 datasheet: 312 TFLOPS BF16/FP16 tensor, dense"),
            ("hbm_bw", "NVIDIA A100 datasheet: HBM2 1,555 GB/s (40 GB)"),
            ("nvlink_bw", "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions)"),
            ("nic_bw", "NVIDIA DGX A100 datasheet: 8 x 200 Gb/s HDR, one per GPU"),
        ),
    ),
    "h100": Accelerator(
        "NVIDIA H100 SXM5 (DGX H100)",
        989 * _T,
        3350 * _GB,
        450 * _GB,
        400e9 / 8,
        (
            ("peak_flops", "NVIDIA H100 datasheet: 1,979 TFLOPS BF16 with sparsity, 989 dense"),
            ("hbm_bw", "NVIDIA H100 datasheet: HBM3 3.35 TB/s (SXM)"),
            ("nvlink_bw", "NVIDIA H100 datasheet: NVLink 900 GB/s (both directions)"),
            ("nic_bw", "NVIDIA DGX H100 datasheet: 8 x 400 Gb/s NDR, one per GPU"),
        ),
    ),
    "h200": Accelerator(  # not the paper's: the lent GPU host's (docs/benchmarks.md, H)
        "NVIDIA H200 SXM",
        989 * _T,
        4800 * _GB,
        450 * _GB,
        400e9 / 8,
        (
            ("peak_flops", "NVIDIA H200 datasheet: 1,979 TFLOPS BF16 with sparsity, 989 dense"),
            ("hbm_bw", "NVIDIA H200 datasheet: HBM3e 4.8 TB/s"),
            ("nvlink_bw", "NVIDIA H200 datasheet: NVLink 900 GB/s (both directions)"),
            ("nic_bw", "as the H100's DGX (8 x 400 Gb/s, one per GPU)"),
        ),
    ),
}

# What no datasheet gives: achieved shares of the peaks and per-message latencies.
ASSUMED: dict[str, tuple[float, str]] = {
    "dense_efficiency": (
        0.35,
        "share of peak FLOP/s the MLPs and interactions reach (small-batch GEMMs, fp32 "
        "optimizer and launch overheads); replaced by measured_efficiency when a GPU ran "
        "the shapes",
    ),
    "lookup_efficiency": (0.6, "share of HBM bandwidth a fused embedding lookup reaches"),
    "nvlink_efficiency": (0.7, "share of NVLink bandwidth an NCCL all-to-all reaches"),
    "nic_efficiency": (
        0.7,
        "share of the NIC's rate an NCCL all-to-all across hosts reaches (RoCE)",
    ),
    "intra_latency": (5e-6, "seconds per peer message inside a host (NVLink)"),
    "cross_latency": (15e-6, "seconds per peer message across hosts (RDMA)"),
    "nics_per_gpu_as_dgx": (
        1.0,
        "the paper's hosts (Meta's) have the reference DGX's NIC bandwidth per GPU",
    ),
}

# The paper's configurations: generation, GPUs, and what it reports. Only what a stored
# copy of the paper or of notes on it states is here; None: not available to us.
PAPER: dict[str, Any] = {
    "title": "Disaggregated Multi-Tower: Topology-aware Modeling Technique for Efficient "
    "Large Scale Recommendation (Luo et al., MLSys 2024, arXiv 2403.00877)",
    "generations": ("v100", "a100", "h100"),
    "gpus_per_host": 8,
    "scales": (16, 32, 64, 128, 256, 512),
    "tower_compression_up_to": 16.0,
    "speedup_at_most": 1.9,  # the abstract's "up to 1.9x": no configuration is faster
    "sources": (
        "arXiv 2403.00877 abstract: up to 1.9x over the state-of-the-art baselines, across "
        "generations of hardware at large data-center scale",
        "sciencestack.ai/paper/2403.00877 summary: DLRM, DCN and XLRM, up to 512 GPUs",
        "a public reading note of the paper (Paper Notes, May 2026): 1.9x on 64 H100 GPUs; "
        "16 to 512 GPUs over V100, A100 and H100; tower-module compression up to 16x",
    ),
}
# (generation, GPUs) -> (reported speed-up of DMT over the flat baseline, what it is)
PAPER_REPORTED: dict[tuple[str, int], tuple[float, str]] = {
    ("h100", 64): (1.9, "the paper's largest speed-up ('up to 1.9x'), its best model"),
}


def cluster_for(
    generation: str, dense_efficiency: float | None = None, ranks_per_host: int = 8
) -> Cluster:
    """The scale model's ``Cluster`` for ``generation`` (a key of ``SPECS``): peaks times
    the ``ASSUMED`` efficiencies; ``dense_efficiency`` replaces the assumed one."""
    if generation not in SPECS:
        raise ValueError(f"unknown GPU generation {generation!r}: use one of {', '.join(SPECS)}")
    spec = SPECS[generation]
    eff = dense_efficiency if dense_efficiency is not None else ASSUMED["dense_efficiency"][0]
    return Cluster(
        ranks_per_host=ranks_per_host,
        intra_host_bw=spec.nvlink_bw * ASSUMED["nvlink_efficiency"][0],
        cross_host_bw=spec.nic_bw * ASSUMED["nic_efficiency"][0],
        intra_latency=ASSUMED["intra_latency"][0],
        cross_latency=ASSUMED["cross_latency"][0],
        hbm_bw=spec.hbm_bw * ASSUMED["lookup_efficiency"][0],
        flops=spec.peak_flops * eff,
    )


def measured_efficiency(path: Path) -> dict[str, Any]:
    """The dense efficiency a GPU reached, from a JSON of measured steps::

        {"device": "NVIDIA H200", "measurements": [
            {"kind": "flat_step" | "tower_module", "flops": <FLOPs of one step>,
             "seconds": <its measured median>}, ...]}

    (``towerrec bench train --device cuda --shapes``): achieved FLOP/s over the device's
    peak (``SPECS``, matched by name), the mean over the measurements."""
    try:
        data = json.loads(Path(path).read_text())
        device = str(data["device"])
        rows = [
            (str(m["kind"]), float(m["flops"]), float(m["seconds"])) for m in data["measurements"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"--gpu-steps {path}: not a JSON of measured GPU steps ({err}); give the JSON of "
            "towerrec bench train --device cuda --shapes (device, measurements: kind, flops, "
            "seconds)"
        ) from err
    generation = next((g for g in SPECS if g in device.lower().replace(" ", "")), None)
    if generation is None or not rows or any(s <= 0 or f <= 0 for _, f, s in rows):
        raise ValueError(
            f"--gpu-steps {path}: device {device!r} is none of {', '.join(SPECS)}, or a "
            "measurement has no FLOPs or time; measure on one of those GPUs"
        )
    peak = SPECS[generation].peak_flops
    kinds = sorted({kind for kind, _, _ in rows})
    per_kind = {  # all of a kind's FLOPs over all its seconds
        k: sum(f for kind, f, _ in rows if kind == k)
        / sum(s for kind, _, s in rows if kind == k)
        / peak
        for k in kinds
    }
    return {
        "device": device,
        "generation": generation,
        "by_kind": per_kind,
        "dense_efficiency": sum(per_kind.values()) / len(per_kind),
    }


def spec_table() -> list[dict[str, Any]]:
    """Every generation's constants and sources, for the report."""
    return [{"key": key, **asdict(spec)} for key, spec in SPECS.items()]


def explain_gap(point: dict[str, Any], reported: float) -> dict[str, Any]:
    """Which term of a predicted step (``predict_step``) explains a predicted speed-up
    ``F / D`` apart from ``reported``: the seconds flat's step would have to gain
    (``R D - F``) or DMT's to lose (``D - F / R``) for the two to agree, set against the
    step's terms (``terms_ms``). Predicted too low: flat's cross-host all-to-alls are
    cheaper in the model than in the paper's runs. Predicted too high: the term of the
    flat step that could lose that much, flat's ``peers x latency`` part (an all-to-all
    that overlaps its peer messages, as NCCL's does, pays less than their sum) if it
    is large enough, else DMT's own collectives."""
    flat, dmt = point["flat"]["step_s"], point["dmt"]["step_s"]
    predicted = flat / dmt
    flat_more = reported * dmt - flat  # seconds flat's step would need to gain
    dmt_less = dmt - flat / reported  # or seconds DMT's step would need to lose
    terms = {
        "flat_comm_ms": 1e3 * point["flat"]["comm_s"],
        "flat_comm_latency_ms": 1e3 * point["flat"]["comm_latency_s"],
        "dmt_comm_ms": 1e3 * point["dmt"]["comm_s"],
        "dmt_tower_ms": 1e3 * point["dmt"]["tower_s"],
        **{f"{k}_ms": 1e3 * v for k, v in point["common_s"].items()},
    }
    if reported >= predicted:
        term = "flat_comm_ms"
        why = (
            f"flat's all-to-alls would take {1e3 * flat_more:.2f} ms more than the model's "
            f"{terms['flat_comm_ms']:.2f} ms (their efficiency across hosts, stragglers, "
            f"congestion), or DMT's step {1e3 * dmt_less:.2f} ms less"
        )
    elif terms["flat_comm_latency_ms"] >= -1e3 * flat_more:
        term = "flat_comm_latency_ms"
        why = (
            f"flat's step would take {-1e3 * flat_more:.2f} ms less: its peers x latency "
            f"term ({terms['flat_comm_latency_ms']:.2f} ms, {point['flat']['peers_per_collective']['cross_host']} "
            "peers across hosts per all-to-all) counts every peer message in turn, where "
            "NCCL overlaps them"
        )
    else:
        term = "dmt_comm_ms"
        why = (
            f"DMT's step would take {-1e3 * dmt_less:.2f} ms more than the model's: its "
            f"collectives ({terms['dmt_comm_ms']:.2f} ms) or its tower modules "
            f"({terms['dmt_tower_ms']:.2f} ms) cost more"
        )
    return {
        "predicted": predicted,
        "reported": reported,
        "ratio": predicted / reported,
        "term": term,
        "terms_ms": terms,
        "flat_step_ms_needed_extra": 1e3 * flat_more,
        "dmt_step_ms_needed_less": 1e3 * dmt_less,
        "why": why,
    }


def compare_with_paper(
    workload: Workload | None = None,
    dense_efficiency: float | None = None,
    tolerance: float = 0.15,
) -> dict[str, Any]:
    """The scale model on the paper's hardware (``SPECS``) at its scales, and beside each
    configuration the paper reports (``PAPER_REPORTED``) the predicted speed-up, the ratio
    and, beyond ``tolerance``, the term that explains the gap (``explain_gap``)."""
    work = workload or Workload()
    sweeps, rows = {}, []
    for generation in PAPER["generations"]:
        cluster = cluster_for(generation, dense_efficiency)
        points = [predict_step(g, cluster, work) for g in PAPER["scales"]]
        sweeps[generation] = {"cluster": asdict(cluster), "points": points}
        for point in points:
            reported = PAPER_REPORTED.get((generation, point["accelerators"]))
            row: dict[str, Any] = {
                "generation": generation,
                "accelerators": point["accelerators"],
                "predicted_speedup": point["speedup"],
                "reported_speedup": reported[0] if reported else None,
                "reported_at_most": PAPER["speedup_at_most"],
            }
            if reported:
                gap = explain_gap(point, reported[0])
                row.update(reported_what=reported[1], ratio=gap["ratio"], gap=gap)
                row["within_tolerance"] = abs(gap["ratio"] - 1) <= tolerance
            else:  # the paper's largest speed-up bounds every configuration's
                row["within_tolerance"] = point["speedup"] <= PAPER["speedup_at_most"] * (
                    1 + tolerance
                )
                if not row["within_tolerance"]:
                    row["gap"] = explain_gap(point, PAPER["speedup_at_most"])
            rows.append(row)
    return {
        "workload": asdict(work),
        "dense_efficiency": dense_efficiency
        if dense_efficiency is not None
        else ASSUMED["dense_efficiency"][0],
        "sweeps": sweeps,
        "comparison": rows,
        "tolerance": tolerance,
    }
