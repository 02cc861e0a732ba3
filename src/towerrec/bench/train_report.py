"""What ``towerrec bench train`` reports of each row: its roofline and its ratios against
TorchRec's faster configuration, from the row's timings and the machine's bounds measured
in the same run (``roofline.py``).

A row's roofline is the least time its step can take at the measured peaks of the
precision the row runs::

    roofline_s = dense training FLOPs of the step / matmul peak (fp32, or bf16 under autocast)
               + embedding bytes of the step    / memory bandwidth

- dense training FLOPs: 3 x the forward FLOPs of the MLPs and the interaction (forward,
  and the two matmuls of each backward) x the batch;
- embedding bytes (``roofline.embedding_step_bytes``): every looked-up row gathered in
  forward, and each distinct row of the batch (per table) with its row-wise Adagrad
  state read and written back by the fused update; the mean over the benchmark's batches.

``roofline_fraction`` = roofline time / measured step time, by the wall clock against the
wall-clock peaks; ``cpu_roofline_fraction`` the same in CPU seconds of this process
against the peaks per CPU second (with one thread, one core's bound however busy the
machine is). 1 is the bound.

Ratios: each row's samples/s over the faster TorchRec configuration's (``vs_torchrec``),
and the TorchRec configuration with the least CPU time per step over the row's
(``cpu_vs_torchrec``), both from the same round-robin run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from towerrec.bench.roofline import Roofline, embedding_step_bytes
from towerrec.data.batch import Batch

__all__ = [
    "StepWork",
    "add_torchrec_ratios",
    "batch_embedding_bytes",
    "cpu_ratios_to",
    "fastest_torchrec",
    "ratios_to",
    "roofline_fields",
]

TORCHREC_ROWS = ("torchrec", "torchrec_no_dmp")


def batch_embedding_bytes(
    batches: Sequence[Batch], dim: int, state_floats_per_row: int = 1
) -> float:
    """Mean bytes one training step on one of ``batches`` moves in fused tables of ``dim``
    (module doc); one feature per table."""
    total = 0
    for b in batches:
        values = b.sparse.values()
        per_table = values.split(b.sparse.length_per_key())
        distinct = sum(torch.unique(v).numel() for v in per_table)
        total += embedding_step_bytes(values.numel(), distinct, dim, state_floats_per_row)
    return total / len(batches)


@dataclass(frozen=True)
class StepWork:
    """What one training step must do at least: dense FLOPs and embedding bytes."""

    flops: float
    embedding_bytes: float


def roofline_fields(
    work: StepWork, step_s: float, cpu_s: float, wall: Roofline, cpu: Roofline
) -> dict[str, float]:
    """A row's roofline, by the wall clock and in CPU seconds (module doc)."""
    roof_s = wall.seconds(work.flops, work.embedding_bytes)
    cpu_roof_s = cpu.seconds(work.flops, work.embedding_bytes)
    return {
        "roofline_ms": round(roof_s * 1e3, 3),
        "roofline_fraction": round(roof_s / step_s, 4),
        "cpu_roofline_ms": round(cpu_roof_s * 1e3, 3),
        "cpu_roofline_fraction": round(cpu_roof_s / cpu_s, 4) if cpu_s > 0 else 0.0,
    }


def ratios_to(results: dict, reference: str) -> dict[str, float]:
    """Each row's samples/s over ``reference``'s."""
    base = results.get(reference, {}).get("samples_per_s")
    return {
        f"{name}/{reference}": round(r["samples_per_s"] / base, 3)
        for name, r in results.items()
        if base and name != reference and "samples_per_s" in r
    }


def cpu_ratios_to(results: dict, reference: str) -> dict[str, float]:
    """Speed-ups by CPU time per step (meaningful with one thread on a shared machine)."""
    base = results.get(reference, {}).get("cpu_ms_per_step")
    return {
        f"{name}/{reference}": round(base / r["cpu_ms_per_step"], 3)
        for name, r in results.items()
        if base and name != reference and r.get("cpu_ms_per_step")
    }


def fastest_torchrec(results: dict, by: str = "samples_per_s") -> str:
    """The faster of TorchRec's single-device configurations (under DMP or its fused
    collection alone) by ``by``: ``samples_per_s`` (wall clock, higher is faster) or
    ``cpu_ms_per_step`` (lower is faster). Each ratio is taken against it."""
    timed = [n for n in TORCHREC_ROWS if by in results.get(n, {})]
    if by == "cpu_ms_per_step":
        return min(timed, key=lambda n: results[n][by], default="torchrec")
    return max(timed, key=lambda n: results[n][by], default="torchrec")


def add_torchrec_ratios(results: dict) -> dict:
    """Each timed row's ``vs_torchrec`` and ``cpu_vs_torchrec`` (module doc), in place; the
    references and the ratio tables for the report's header."""
    reference = fastest_torchrec(results)
    cpu_reference = fastest_torchrec(results, "cpu_ms_per_step")
    base = results.get(reference, {}).get("samples_per_s")
    cpu_base = results.get(cpu_reference, {}).get("cpu_ms_per_step")
    for row in results.values():
        if base and "samples_per_s" in row:
            row["vs_torchrec"] = round(row["samples_per_s"] / base, 3)
        if cpu_base and row.get("cpu_ms_per_step"):
            row["cpu_vs_torchrec"] = round(cpu_base / row["cpu_ms_per_step"], 3)
    return {
        "torchrec_reference": reference,
        "ratios": ratios_to(results, reference),
        "cpu_torchrec_reference": cpu_reference,
        "cpu_ratios": cpu_ratios_to(results, cpu_reference),
    }
