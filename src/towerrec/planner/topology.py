"""The machines a plan targets: hosts x ranks, memory per tier, bandwidths.

::

    host 0                              host 1
    ┌───────────────────────────┐       ┌───────────────────────────┐
    │ rank 0   rank 1  ...  L-1 │ cross │ rank L  ...        2L-1   │
    │ [device memory, memory bw]│◄─────►│                           │
    │ └── intra-host link ──┘   │ host  │                           │
    │ host memory (DDR)         │ link  │                           │
    └───────────────────────────┘       └───────────────────────────┘

Bandwidths are bytes per second per rank. Presets describe typical machines;
``towerrec plan --calibrate`` measures the one at hand (planner.cost).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from towerrec.utils import positive

__all__ = ["PRESETS", "Topology", "topology_preset"]

GiB = 1 << 30


@dataclass(frozen=True)
class Topology:
    hosts: int = 1
    ranks_per_host: int = 4
    device_memory: float = 16 * GiB  # bytes for embeddings on each rank (accelerator tier)
    host_memory: float = 256 * GiB  # bytes of host DDR per host (reported, not planned into)
    memory_bandwidth: float = 1.5e12  # device memory, bytes/s
    intra_host_bandwidth: float = 150e9  # rank to rank inside a host (NVLink), bytes/s
    cross_host_bandwidth: float = 12.5e9  # per rank across hosts (NIC), bytes/s
    device_kind: str = "gpu"

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(
                f"topology needs hosts >= 1 and ranks_per_host >= 1, got {self.hosts} x "
                f"{self.ranks_per_host}"
            )
        for key in (
            "device_memory",
            "host_memory",
            "memory_bandwidth",
            "intra_host_bandwidth",
            "cross_host_bandwidth",
        ):
            positive(f"topology.{key}", getattr(self, key))

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host


PRESETS = {
    # A100-class GPU hosts: HBM2e, NVLink inside the host, 100 Gb/s per GPU across.
    "gpu": Topology(),
    # This kind of machine: each rank a process on a shared CPU, links are loopback TCP.
    "cpu": Topology(
        device_memory=4 * GiB,
        host_memory=24 * GiB,
        memory_bandwidth=20e9,
        intra_host_bandwidth=2e9,
        cross_host_bandwidth=1e9,
        device_kind="cpu",
    ),
}


def topology_preset(name: str, hosts: int, ranks_per_host: int, **overrides: Any) -> Topology:
    if name not in PRESETS:
        raise ValueError(f"unknown topology preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], hosts=hosts, ranks_per_host=ranks_per_host, **overrides)
