"""What a host's memory tiers hold and how fast rows move between them: ``TierSpec``.

Capacities in bytes, bandwidths in bytes/s, per host. ``tier_spec_for`` derives
one from a topology preset (PCIe per GPU, a data-centre NVMe drive; on CPU the
"device" and host tiers are both DDR) and replaces the SSD's and the host copy's
speeds with those ``towerrec plan --calibrate`` measured (calibration/storage.py).
The cost of one miss, a row fetched and the dirty row it evicts written back::

    host   2 x row / host bandwidth
    ssd    latency / io depth + max(row, 4 KiB) / read bandwidth + row / write bandwidth
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from towerrec.planner.topology import GiB, Topology
from towerrec.utils import at_least, positive

__all__ = ["SSD_PAGE_BYTES", "TierSpec", "tier_spec_for"]

SSD_PAGE_BYTES = 4096


@dataclass(frozen=True)
class TierSpec:
    """One host's memory tiers: capacities in bytes, bandwidths in bytes/s."""

    device_memory: float  # accelerator memory for embeddings, all ranks of the host
    host_memory: float  # DDR for backing tables
    ssd_capacity: float  # 0: no SSD tier
    host_bandwidth: float  # rows between host memory and the device (PCIe; CPU: DDR copy)
    ssd_read_bandwidth: float = 3e9
    ssd_write_bandwidth: float = 2e9
    ssd_read_latency_s: float = 100e-6  # one random 4 KiB read at queue depth 1
    ssd_io_depth: int = 32  # random reads in flight
    source: str = "preset"

    def __post_init__(self) -> None:
        for key in ("device_memory", "host_memory", "ssd_capacity", "ssd_read_latency_s"):
            at_least(f"tier spec {key}", getattr(self, key), 0)
        for key in ("host_bandwidth", "ssd_read_bandwidth", "ssd_write_bandwidth"):
            positive(f"tier spec {key}", getattr(self, key), unit="bytes/s")
        at_least("tier spec ssd_io_depth", self.ssd_io_depth, 1)

    def host_miss_seconds(self, row_bytes: float) -> float:
        return 2 * row_bytes / self.host_bandwidth

    def ssd_miss_seconds(self, row_bytes: float) -> float:
        return (
            self.ssd_read_latency_s / self.ssd_io_depth
            + max(row_bytes, SSD_PAGE_BYTES) / self.ssd_read_bandwidth
            + row_bytes / self.ssd_write_bandwidth
        )

    def scaled(self, hosts: int) -> TierSpec:
        """``hosts`` of these hosts as one pool (capacities and bandwidths add up)."""
        return replace(
            self,
            device_memory=self.device_memory * hosts,
            host_memory=self.host_memory * hosts,
            ssd_capacity=self.ssd_capacity * hosts,
            host_bandwidth=self.host_bandwidth * hosts,
            ssd_read_bandwidth=self.ssd_read_bandwidth * hosts,
            ssd_write_bandwidth=self.ssd_write_bandwidth * hosts,
            ssd_io_depth=self.ssd_io_depth * hosts,
        )


# Host-to-device bandwidth per rank (PCIe 4 x16 at a typical efficiency) and a data
# centre NVMe drive per host; on CPU the "device" and host tiers are both DDR.
_PCIE_PER_RANK = 25e9
_SSD_PRESET: dict[str, float] = {"ssd_capacity": 2048 * GiB}


def tier_spec_for(topology: Topology, storage: dict[str, Any] | None = None) -> TierSpec:
    """One host of ``topology`` as tiers; ``storage`` (a calibration's ``storage``
    section) replaces the SSD's and the host copy's preset speeds with measured ones."""
    ranks = topology.ranks_per_host
    host_bw = _PCIE_PER_RANK * ranks if topology.device_kind == "gpu" else topology.memory_bandwidth
    spec = TierSpec(
        device_memory=topology.device_memory * ranks,
        host_memory=topology.host_memory,
        ssd_capacity=_SSD_PRESET["ssd_capacity"],
        host_bandwidth=host_bw,
    )
    if storage:
        keys = ("ssd_read_bandwidth", "ssd_write_bandwidth", "ssd_read_latency_s")
        measured: dict[str, Any] = {k: float(storage[k]) for k in keys if k in storage}
        if topology.device_kind != "gpu" and "host_copy_bandwidth" in storage:
            measured["host_bandwidth"] = float(storage["host_copy_bandwidth"])
        where = storage.get("path", "calibration")
        spec = replace(spec, **measured, source=f"measured ({where})")
    return spec
