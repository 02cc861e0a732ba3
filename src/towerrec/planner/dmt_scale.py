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

The default constants are placeholders of realistic order (NVLink-class 300
GB/s inside a host, 25-50 GB/s RoCE per accelerator between hosts).
``fit_link_constants`` fits the links' constants (latency per peer message and
bandwidth, inside and across hosts) to steps measured by ``towerrec bench dmt``
instead (``towerrec bench dmt-scale --measured``); the compute constants stay
assumed (the measured machine's compute is not an accelerator's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from towerrec.utils import positive

__all__ = [
    "LINK_TERMS",
    "Cluster",
    "MeasuredStep",
    "Workload",
    "evaluate_fit",
    "fit_link_constants",
    "fit_terms",
    "peer_messages",
    "predict_step",
    "scale_sweep",
]


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
            positive(f"Cluster.{name}", value)


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
            positive(f"Workload.{name}", value)


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
    # of the collectives' time, the peers x latency part (3 all-to-alls: ids, rows, grads)
    flat_latency = 3 * ((g - local) * cluster.cross_latency + (local - 1) * cluster.intra_latency)
    dmt_latency = 3 * ((hosts - 1) * cluster.cross_latency + (local - 1) * cluster.intra_latency)

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
            "comm_latency_s": flat_latency if hosts > 1 else 0.0,
            "step_s": flat_step,
            "samples_per_s": g * b / flat_step,
        },
        "dmt": {
            "cross_host_bytes_per_sample": dmt_cross / b,
            "intra_host_bytes_per_sample": dmt_intra / b,
            "peers_per_collective": {"cross_host": hosts - 1, "intra_host": local - 1},
            "comm_s": dmt_comm,
            "comm_latency_s": dmt_latency if hosts > 1 else 0.0,
            "tower_s": tower_s,
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


# ---------------------------------------------------------------- calibration
# What ``towerrec bench dmt`` measures (its JSON report, one row per variant and network)
# is turned into the constants above: latency per peer message and seconds per byte for
# each link class. A step's time on rank r is modelled as
#
#   step = c_model + a_loop m_loop + a_link m_link + b_loop bytes_loop + k_link link_s
#
# c_model    the step without communication, one constant per model (flat DLRM, DMT)
#            and embedding dim (``c_dlrm_d16``, ...): the measured machine's compute
#            is not the scale model's accelerators'
# m_*        peer messages a rank waits for per step, by link class (``peer_messages``)
# bytes_loop bytes a rank sends per step over the host's own links (loopback here)
# link_s     seconds the cross-host bytes need on the link at its nominal rate (each
#            direction carries half of them); k_link = 1 / the link's efficiency
#
# On a run without a shaped link (``--network local``) every byte and message is the
# host's own (loopback), so the two classes separate only across runs of both kinds.

LINK_TERMS = ("a_loop", "a_link", "b_loop", "k_link")


@dataclass(frozen=True)
class MeasuredStep:
    """One variant's measured step (``towerrec bench dmt``'s report row and settings)."""

    variant: str
    layout: str  # flat_<sharding> | dmt
    hosts: int
    ranks_per_host: int
    batch_size: int  # global
    step_s: float
    cross_bytes_per_sample: float  # all ranks, embedding collectives + dense all-reduce
    intra_bytes_per_sample: float
    calls_per_step: dict[str, float]  # one rank's collective calls per step, by name
    link_bytes_per_s: float | None = None  # the shaped link's rate each way; None: loopback
    network: str = "local"
    embedding_dim: int = 16

    @property
    def compute_term(self) -> str:
        """The name of this step's compute constant: its model and embedding dim."""
        return f"c_{'dmt' if self.layout == 'dmt' else 'dlrm'}_d{self.embedding_dim}"


def peer_messages(
    layout: str, name: str, hosts: int, ranks_per_host: int, calls: float
) -> tuple[float, float]:
    """(intra-host, cross-host) peer messages a rank waits for in ``calls`` calls of the
    collective ``name`` under ``layout``: an all-to-all waits for each peer once; a ring
    all-reduce over n ranks takes 2 (n - 1) steps, each as slow as its slowest link (a
    ring over several hosts has cross-host links). The tower transform's DDP over the
    host (one of a DMT's ``dense_allreduce`` calls per step) stays inside."""
    local, world = ranks_per_host, hosts * ranks_per_host
    if name == "dense_allreduce":
        world_calls, host_calls = calls, 0.0
        if layout == "dmt" and calls >= 1:  # bottom and top over the world, the tower inside
            world_calls, host_calls = calls - 1, 1.0
        inside, ring = 2 * (local - 1) * host_calls, 2 * (world - 1) * world_calls
        return (inside, ring) if hosts > 1 else (inside + ring, 0.0)
    if name in ("dense_reduce_scatter", "dense_all_gather"):
        return (local - 1) * calls, 0.0
    if name == "dense_allreduce_cross":
        return 0.0, 2 * (hosts - 1) * calls
    if name.startswith("tower_"):
        return 0.0, (hosts - 1) * calls
    if layout == "dmt":  # the host lookup's collectives
        return (local - 1) * calls, 0.0
    if name.startswith("output_host_reduce"):
        return (local - 1) * calls, 0.0
    if name.startswith("output_cross_host"):
        return 0.0, (hosts - 1) * calls
    return (local - 1) * calls, (world - local) * calls  # an all-to-all over the world


def fit_terms(step: MeasuredStep) -> dict[str, float]:
    """The regressors of ``step`` by name: its compute term and ``LINK_TERMS`` (module
    comment above)."""
    world = step.hosts * step.ranks_per_host
    intra = cross = 0.0
    for name, calls in step.calls_per_step.items():
        i, c = peer_messages(step.layout, name, step.hosts, step.ranks_per_host, calls)
        intra, cross = intra + i, cross + c
    per_rank = step.batch_size / world
    cross_bytes = step.cross_bytes_per_sample * per_rank
    intra_bytes = step.intra_bytes_per_sample * per_rank
    if step.link_bytes_per_s is None:  # loopback: both classes on the host's links
        links = (intra + cross, 0.0, intra_bytes + cross_bytes, 0.0)
    else:
        link_s = step.cross_bytes_per_sample * step.batch_size / 2 / step.link_bytes_per_s
        links = (intra, cross, intra_bytes, link_s)
    return {step.compute_term: 1.0, **dict(zip(LINK_TERMS, links, strict=True))}


def _nonnegative_lstsq(x: Any, y: Any) -> Any:
    """Least squares with every coefficient >= 0: terms whose coefficient comes out
    negative are dropped (held at 0) and the rest refitted, until none is negative."""
    import numpy as np

    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda j: coef[j]))


def fit_link_constants(steps: list[MeasuredStep]) -> dict[str, Any]:
    """Fit the compute terms (one per model and dim present) and ``LINK_TERMS`` to measured
    steps by non-negative least squares; the constants for ``Cluster`` (latency per
    message and bandwidth per link class, the link's efficiency) and each step's fitted
    time and residual."""
    import numpy as np

    names = sorted({s.compute_term for s in steps}) + list(LINK_TERMS)
    if len(steps) < len(names):
        raise ValueError(
            f"{len(steps)} measured steps cannot fit {len(names)} constants; give the "
            "bench dmt reports of a loopback run and of shaped links at several rates"
        )
    if not any(s.link_bytes_per_s for s in steps):
        raise ValueError(
            "no measured step ran over a shaped link, so the cross-host link's constants "
            "cannot be told from the host's; add bench dmt --network netns reports"
        )
    x = np.array([[fit_terms(s).get(n, 0.0) for n in names] for s in steps])
    y = np.array([s.step_s for s in steps])
    coef = _nonnegative_lstsq(x, y)
    fitted = x @ coef
    values = dict(zip(names, coef.tolist(), strict=True))
    residuals = [
        {
            "variant": s.variant,
            "embedding_dim": s.embedding_dim,
            "network": s.network,
            "link_gbit": s.link_bytes_per_s * 8 / 1e9 if s.link_bytes_per_s else None,
            "measured_ms": 1e3 * s.step_s,
            "fitted_ms": 1e3 * f,
            "residual_ms": 1e3 * (s.step_s - f),
        }
        for s, f in zip(steps, fitted.tolist(), strict=True)
    ]
    rms = float(np.sqrt(np.mean((y - fitted) ** 2)))
    return {
        "terms": values,
        **_constants(values),
        "rms_residual_ms": 1e3 * rms,
        "max_abs_residual_ms": max(abs(r["residual_ms"]) for r in residuals),
        "residuals": residuals,
        "points": len(steps),
    }


def _constants(values: dict[str, float]) -> dict[str, Any]:
    return {
        "constants": {
            "intra_latency": values["a_loop"],
            "cross_latency": values["a_link"],
            "intra_host_bw": 1.0 / values["b_loop"] if values["b_loop"] else float("inf"),
            "link_efficiency": 1.0 / values["k_link"] if values["k_link"] else float("inf"),
        },
    }


def evaluate_fit(fit: dict[str, Any], steps: list[MeasuredStep]) -> dict[str, Any]:
    """The fitted model (``fit_link_constants``) on steps it was not fitted to: each step's
    predicted time and residual; a step whose model and dim the fit has no compute term
    for is listed as not predicted."""
    rows, errors = [], []
    for s in steps:
        row = {
            "variant": s.variant,
            "embedding_dim": s.embedding_dim,
            "network": s.network,
            "link_gbit": s.link_bytes_per_s * 8 / 1e9 if s.link_bytes_per_s else None,
            "measured_ms": 1e3 * s.step_s,
        }
        if s.compute_term not in fit["terms"]:
            rows.append({**row, "not_predicted": f"no {s.compute_term} in the fit"})
            continue
        predicted = sum(fit["terms"][name] * x for name, x in fit_terms(s).items())
        errors.append(s.step_s - predicted)
        rows.append(
            {**row, "fitted_ms": 1e3 * predicted, "residual_ms": 1e3 * (s.step_s - predicted)}
        )
    return {
        "residuals": rows,
        "rms_residual_ms": 1e3 * (sum(e * e for e in errors) / len(errors)) ** 0.5
        if errors
        else None,
        "max_abs_residual_ms": 1e3 * max(abs(e) for e in errors) if errors else None,
        "points": len(errors),
    }
