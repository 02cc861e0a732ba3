"""Analytic scale model: one training step of flat DLRM vs DMT on H hosts x L accelerators.

Pure arithmetic, no torch. A step on every rank (local batch B)::

    flat (table-wise over all G = H*L ranks)
      input all-to-all     ids of every feature to the table's owner      G-1 peers
      output all-to-all    pooled embeddings back, fwd + grads in bwd     G-1 peers
    DMT (tower t on host t, T/H features each)
      peer all-to-all      ids of tower t's features to host t           H-1 peers (rank l <-> rank l)
      intra all-to-all     ids + pooled embeddings inside the host        L-1 peers
      tower module         on the host's peer batch (H*B samples)
      peer all-to-all      compressed tower outputs back, fwd + grads     H-1 peers
    both                   lookup (HBM reads), dense compute, dense-gradient
                           all-reduce of the shared MLPs (hierarchical ring)

A collective's time on one rank is ``peers * latency + bytes / bandwidth``
for each link class (intra-host, cross-host), with the bytes that rank sends
over that class; every rank sends the same amount (balanced tables), so the
step time is compute + lookup + the sum of the collectives (no overlap: an
upper bound for both). Of a flat all-to-all, ``(G-L)/G`` of the bytes cross
hosts; of DMT's, the peer exchanges cross and the rest stays inside.

The constants are placeholders of realistic order (NVLink-class 300 GB/s
inside a host, 25-50 GB/s RoCE per accelerator between hosts); a calibrated
cost model can pass its own ``Cluster``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Cluster", "Workload", "predict_step", "scale_sweep"]


@dataclass(frozen=True)
class Cluster:
    ranks_per_host: int = 8
    intra_host_bw: float = 300e9  # bytes/s per accelerator (NVLink class)
    cross_host_bw: float = 25e9  # bytes/s per accelerator (200 Gbit/s RoCE NIC)
    intra_latency: float = 3e-6  # seconds per peer message
    cross_latency: float = 12e-6
    hbm_bw: float = 2e12  # bytes/s, embedding lookups
    flops: float = 400e12 * 0.35  # achieved dense FLOP/s

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"Cluster.{name} must be > 0, got {value}")


@dataclass(frozen=True)
class Workload:
    batch_per_rank: int = 1024
    num_features: int = 512
    embedding_dim: int = 128
    pooling_factor: float = 20.0
    id_bytes: int = 4
    value_bytes: int = 2  # fp16/bf16 pooled embeddings and their gradients
    dense_flops_per_sample: float = 3 * 60e6  # forward + backward of the MLPs and interaction
    dense_params: float = 50e6  # shared MLP parameters all-reduced every step
    grad_bytes: int = 4
    compression: float = 4.0  # DMT tower module: floats in / floats out per sample
    tower_flops_per_sample: float = 3 * 4e6

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"Workload.{name} must be > 0, got {value}")


def _a2a(peers: int, nbytes: float, latency: float, bw: float) -> float:
    return peers * latency + nbytes / bw if peers else 0.0


def predict_step(num_accelerators: int, cluster: Cluster, work: Workload) -> dict[str, Any]:
    """Per-step time and traffic of flat and DMT for ``num_accelerators`` ranks (module doc)."""
    local = cluster.ranks_per_host
    if num_accelerators < local or num_accelerators % local:
        raise ValueError(
            f"num_accelerators = {num_accelerators} must be a multiple of ranks_per_host = {local}"
        )
    g, hosts, b = num_accelerators, num_accelerators // local, work.batch_per_rank
    if work.num_features < hosts:
        raise ValueError(
            f"{work.num_features} features cannot fill {hosts} towers; use fewer hosts or more "
            "features"
        )
    ids = work.num_features * work.pooling_factor * work.id_bytes  # per sample
    pooled = work.num_features * work.embedding_dim * work.value_bytes  # per sample
    outputs = pooled / work.compression  # all towers' outputs, per sample
    cross_share, intra_share = (g - local) / g, (local - 1) / g

    # ---- shared by both: lookups, dense compute, hierarchical all-reduce of dense grads
    lookup_s = b * work.num_features * work.pooling_factor * work.embedding_dim * 4 / cluster.hbm_bw
    compute_s = b * work.dense_flops_per_sample / cluster.flops
    grads = work.dense_params * work.grad_bytes
    allreduce_s = (
        2 * (local - 1) / local * grads / cluster.intra_host_bw
        + 2 * (hosts - 1) / hosts * grads / local / cluster.cross_host_bw
        + 2 * ((local - 1) * cluster.intra_latency + (hosts - 1) * cluster.cross_latency)
    )
    common = lookup_s + compute_s + allreduce_s

    # ---- flat: table-wise over all ranks; fwd ids + pooled, bwd pooled grads
    flat_cross = b * (ids + 2 * pooled) * cross_share
    flat_intra = b * (ids + 2 * pooled) * intra_share
    flat_comm = (
        _a2a(g - local, b * ids * cross_share, cluster.cross_latency, cluster.cross_host_bw)
        + _a2a(local - 1, b * ids * intra_share, cluster.intra_latency, cluster.intra_host_bw)
        + 2
        * _a2a(g - local, b * pooled * cross_share, cluster.cross_latency, cluster.cross_host_bw)
        + 2
        * _a2a(local - 1, b * pooled * intra_share, cluster.intra_latency, cluster.intra_host_bw)
    )

    # ---- DMT: peer exchanges cross hosts, lookups stay inside
    peer_share = (hosts - 1) / hosts
    dmt_cross = b * (ids + 2 * outputs) * peer_share
    # inside host h: the peer batch (H*B samples) of tower h's T/H features
    tower_ids, tower_pooled = ids / hosts, pooled / hosts
    dmt_intra = hosts * b * (tower_ids + 2 * tower_pooled) * (local - 1) / local
    dmt_comm = (
        _a2a(hosts - 1, b * ids * peer_share, cluster.cross_latency, cluster.cross_host_bw)
        + _a2a(
            local - 1,
            hosts * b * tower_ids * (local - 1) / local,
            cluster.intra_latency,
            cluster.intra_host_bw,
        )
        + 2
        * _a2a(
            local - 1,
            hosts * b * tower_pooled * (local - 1) / local,
            cluster.intra_latency,
            cluster.intra_host_bw,
        )
        + 2
        * _a2a(hosts - 1, b * outputs * peer_share, cluster.cross_latency, cluster.cross_host_bw)
    )
    tower_s = b * work.tower_flops_per_sample / cluster.flops

    flat_step = common + flat_comm
    dmt_step = common + tower_s + dmt_comm
    return {
        "accelerators": g,
        "hosts": hosts,
        "flat": {
            "cross_host_bytes_per_sample": flat_cross / b,
            "intra_host_bytes_per_sample": flat_intra / b,
            "peers_per_collective": {"cross_host": g - local, "intra_host": local - 1},
            "comm_s": flat_comm,
            "step_s": flat_step,
            "samples_per_s": g * b / flat_step,
        },
        "dmt": {
            "cross_host_bytes_per_sample": dmt_cross / b,
            "intra_host_bytes_per_sample": dmt_intra / b,
            "peers_per_collective": {"cross_host": hosts - 1, "intra_host": local - 1},
            "comm_s": dmt_comm,
            "step_s": dmt_step,
            "samples_per_s": g * b / dmt_step,
        },
        "common_s": {"lookup": lookup_s, "compute": compute_s, "allreduce": allreduce_s},
        "speedup": flat_step / dmt_step,
        "cross_host_bytes_ratio": flat_cross / dmt_cross if dmt_cross else float("inf"),
    }


def scale_sweep(
    accelerators: tuple[int, ...] = (16, 32, 64, 128, 256, 512),
    cluster: Cluster | None = None,
    work: Workload | None = None,
) -> dict[str, Any]:
    cluster, work = cluster or Cluster(), work or Workload()
    return {
        "cluster": asdict(cluster),
        "workload": asdict(work),
        "points": [predict_step(g, cluster, work) for g in accelerators],
    }
