"""What ``towerrec bench train`` reports of each row: its roofline and its ratios against
TorchRec's fastest configuration and against the strongest peer, from the row's timings
and the machine's bounds measured in the same run (``roofline.py``).

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

Beside it, the bound of the step's own shapes (``roofline.layer_matmul_seconds``): the
MLPs' matmuls of one step (forward, the weights' gradients, the inputs' gradients but the
bottom MLP's first) each timed alone at its shape and precision, plus the embedding bytes
at the bandwidth: ``shapes_matmul_ms``, ``shapes_bound_ms`` and ``shapes_bound_fraction``
(= that bound / measured step time). Where the roofline's fraction is low, this one tells
how much of the gap the matmuls' shapes explain (a small MLP's matmuls run far below the
peak whoever calls them) and how much is the rest of the step.

Ratios, all from the same round-robin run: each row's samples/s over the fastest TorchRec
row's, at any precision (``vs_torchrec``), and over the fastest peer's, TorchRec or the
plain PyTorch DLRM (``vs_strongest_peer``); the CPU time per step of the TorchRec row, or
of the peer, with the least of it over the row's (``cpu_vs_torchrec``,
``cpu_vs_strongest_peer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from towerrec.bench.roofline import Roofline, embedding_step_bytes
from towerrec.data.batch import Batch

__all__ = [
    "StepWork",
    "add_peer_ratios",
    "batch_embedding_bytes",
    "cpu_ratios_to",
    "fastest_torchrec",
    "is_peer",
    "is_torchrec",
    "ratios_to",
    "roofline_fields",
]

TORCHREC_PREFIX, PLAIN_PREFIX = "torchrec", "plain_"


def is_torchrec(name: str) -> bool:
    """A TorchRec row: ``torchrec`` (under DMP), ``torchrec_no_dmp``, ``_bf16`` of either."""
    return name == TORCHREC_PREFIX or name.startswith(TORCHREC_PREFIX + "_")


def is_peer(name: str) -> bool:
    """A row of another system than towerrec: TorchRec or the plain PyTorch DLRM."""
    return is_torchrec(name) or name.startswith(PLAIN_PREFIX)


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
    work: StepWork,
    step_s: float,
    cpu_s: float,
    wall: Roofline,
    cpu: Roofline,
    matmuls_s: float | None = None,
) -> dict[str, float]:
    """A row's roofline, by the wall clock and in CPU seconds, and with ``matmuls_s`` (the
    step's linear-layer matmuls timed alone at their shapes) its shapes' bound (module
    doc)."""
    roof_s = wall.seconds(work.flops, work.embedding_bytes)
    cpu_roof_s = cpu.seconds(work.flops, work.embedding_bytes)
    fields = {
        "roofline_ms": round(roof_s * 1e3, 3),
        "roofline_fraction": round(roof_s / step_s, 4),
        "cpu_roofline_ms": round(cpu_roof_s * 1e3, 3),
        "cpu_roofline_fraction": round(cpu_roof_s / cpu_s, 4) if cpu_s > 0 else 0.0,
    }
    if matmuls_s is not None:
        bound_s = matmuls_s + work.embedding_bytes / wall.bandwidth
        fields["shapes_matmul_ms"] = round(matmuls_s * 1e3, 3)
        fields["shapes_bound_ms"] = round(bound_s * 1e3, 3)
        fields["shapes_bound_fraction"] = round(bound_s / step_s, 4)
    return fields


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


def _fastest(results: dict, rows: Callable[[str], bool], by: str, default: str) -> str:
    timed = [n for n, r in results.items() if rows(n) and by in r]
    if by == "cpu_ms_per_step":
        return min(timed, key=lambda n: results[n][by], default=default)
    return max(timed, key=lambda n: results[n][by], default=default)


def fastest_torchrec(results: dict, by: str = "samples_per_s") -> str:
    """The fastest of TorchRec's single-device rows (under DMP or its fused collection
    alone, at any precision) by ``by``: ``samples_per_s`` (wall clock, higher is faster)
    or ``cpu_ms_per_step`` (lower is faster). Each ``vs_torchrec`` is taken against it."""
    return _fastest(results, is_torchrec, by, TORCHREC_PREFIX)


def _add_ratios(results: dict, reference: str, cpu_reference: str, key: str) -> None:
    base = results.get(reference, {}).get("samples_per_s")
    cpu_base = results.get(cpu_reference, {}).get("cpu_ms_per_step")
    for row in results.values():
        if base and "samples_per_s" in row:
            row[key] = round(row["samples_per_s"] / base, 3)
        if cpu_base and row.get("cpu_ms_per_step"):
            row[f"cpu_{key}"] = round(cpu_base / row["cpu_ms_per_step"], 3)


def add_peer_ratios(results: dict) -> dict:
    """Each timed row's ``vs_torchrec``, ``cpu_vs_torchrec``, ``vs_strongest_peer`` and
    ``cpu_vs_strongest_peer`` (module doc), in place; the references and the ratio tables
    for the report's header."""
    reference = fastest_torchrec(results)
    cpu_reference = fastest_torchrec(results, "cpu_ms_per_step")
    _add_ratios(results, reference, cpu_reference, "vs_torchrec")
    peer = _fastest(results, is_peer, "samples_per_s", reference)
    cpu_peer = _fastest(results, is_peer, "cpu_ms_per_step", cpu_reference)
    _add_ratios(results, peer, cpu_peer, "vs_strongest_peer")
    return {
        "torchrec_reference": reference,
        "ratios": ratios_to(results, reference),
        "cpu_torchrec_reference": cpu_reference,
        "cpu_ratios": cpu_ratios_to(results, cpu_reference),
        "strongest_peer": peer,
        "cpu_strongest_peer": cpu_peer,
    }
