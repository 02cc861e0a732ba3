"""Analytic cost model: seconds per training iteration of one shard, and of a device.

For a shard of ``c`` columns and a fraction ``f`` of a table's rows, with B
samples per rank, W ranks on H hosts of L ranks and G = B*W samples per
iteration (pf = pooling factor, v = bytes per value)::

    forward lookup     G*pf*f * (c*v / lookup bandwidth + s_id)
    backward + update  (G*c*v + distinct(G, f) * (2*c*v + state)) / update bandwidth
                       + distinct(G, f) * s_row
    input all-to-all   ids G*pf*f * id_bytes        split intra / cross host
    output all-to-all  2 * G*c*v (pooled out, gradients back), split intra / cross host

(row-wise shards send partial sums: the same G*c*v; data-parallel replicas
look up B*pf locally and all-reduce the table's gradient instead.) Bytes from
ranks of the same host, (L-1)/W of them, cross the intra-host link; the rest,
(W-L)/W, the cross-host link.

A device's cost is not the sum of its shards' costs: the shards of one width
share one fused kernel, so it pays ``kernel_overhead_s`` per distinct width and
``table_overhead_s`` per shard on top. Constants default to typical
efficiencies of the topology's bandwidths; ``towerrec plan --calibrate``
measures them on the machine at hand and writes them as JSON
(``CostConstants.load``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from towerrec.planner.stats import TableStats
from towerrec.planner.topology import Topology
from towerrec.sharding import ShardingType

__all__ = ["CostConstants", "CostModel", "ShardCost"]


@dataclass(frozen=True)
class CostConstants:
    """Efficiencies and overheads; absolute bandwidths (bytes/s) override the
    topology's when > 0 (calibration sets them)."""

    lookup_efficiency: float = 0.5
    update_efficiency: float = 0.25
    link_efficiency: float = 0.8
    lookup_bandwidth: float = 0.0
    update_bandwidth: float = 0.0
    intra_host_bandwidth: float = 0.0
    cross_host_bandwidth: float = 0.0
    lookup_s_per_id: float = 0.0  # per looked-up id, forward + backward (CPU kernels)
    update_s_per_row: float = 0.0  # per updated row
    kernel_overhead_s: float = 30e-6
    table_overhead_s: float = 2e-6
    collective_latency_s: float = 20e-6
    bytes_per_value: int = 4
    optimizer_bytes_per_row: int = 4  # row-wise Adagrad: one float per row
    optimizer_bytes_per_value: int = 0  # state per element (Adagrad 4, Adam 8)
    id_bytes: int = 8
    source: str = "default"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and (not isinstance(value, int | float) or value < 0):
                raise ValueError(f"cost constant {f.name} must be a number >= 0, got {value!r}")
        for key in ("lookup_efficiency", "update_efficiency", "link_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(
                    f"cost constant {key} must lie in (0, 1], got {getattr(self, key)}"
                )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> CostConstants:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"calibration file {str(path)!r} does not exist; write one with "
                "`towerrec plan --calibrate`"
            )
        data = read_calibration(path)
        known = {f.name for f in fields(CostConstants)}
        constants = {k: v for k, v in data.get("constants", data).items() if k in known}
        try:
            return CostConstants(**constants)
        except ValueError as e:
            raise ValueError(f"calibration file {str(path)!r}: {e}") from None


def read_calibration(path: Path) -> Any:
    """The JSON a calibration file holds (``towerrec plan --calibrate`` writes it)."""
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(
            f"calibration file {str(path)!r} is not valid JSON ({e}); write it again with "
            "`towerrec plan --calibrate`"
        ) from None


@dataclass(frozen=True)
class ShardCost:
    """Seconds per iteration of one shard, by part."""

    lookup: float
    update: float
    input_comm: float
    output_comm: float

    @property
    def compute(self) -> float:
        return self.lookup + self.update

    @property
    def comm(self) -> float:
        return self.input_comm + self.output_comm

    @property
    def total(self) -> float:
        return self.compute + self.comm


class CostModel:
    """Costs and memory of shards for ``batch_size`` samples per rank on ``topology``."""

    def __init__(
        self, topology: Topology, constants: CostConstants | None = None, batch_size: int = 1024
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.topology = topology
        self.constants = c = constants or CostConstants()
        self.batch_size = batch_size
        self.lookup_bw = c.lookup_bandwidth or topology.memory_bandwidth * c.lookup_efficiency
        self.update_bw = c.update_bandwidth or topology.memory_bandwidth * c.update_efficiency
        self.intra_bw = c.intra_host_bandwidth or topology.intra_host_bandwidth * c.link_efficiency
        self.cross_bw = c.cross_host_bandwidth or topology.cross_host_bandwidth * c.link_efficiency

    def with_batch_size(self, batch_size: int) -> CostModel:
        return CostModel(self.topology, self.constants, batch_size)

    def with_topology(self, **changes: Any) -> CostModel:
        return CostModel(replace(self.topology, **changes), self.constants, self.batch_size)

    # ------------------------------------------------------------ shards
    def shard_memory(self, stats: TableStats, rows: int, cols: int) -> float:
        c = self.constants
        per_value = c.bytes_per_value + c.optimizer_bytes_per_value
        return rows * (cols * per_value + c.optimizer_bytes_per_row)

    def _row_update_bytes(self, cols: int) -> int:
        """Bytes an update moves per touched row: the row and its element-wise optimizer
        state read and written, and its row-wise state."""
        c = self.constants
        return 2 * cols * (c.bytes_per_value + c.optimizer_bytes_per_value) + (
            c.optimizer_bytes_per_row
        )

    def _link_seconds(self, nbytes: float) -> float:
        """Seconds for ``nbytes`` gathered from (or scattered to) every rank evenly."""
        topo = self.topology
        world, local = topo.world_size, topo.ranks_per_host
        intra = nbytes * (local - 1) / world
        cross = nbytes * (world - local) / world
        return intra / self.intra_bw + cross / self.cross_bw

    def shard_cost(
        self, stats: TableStats, sharding: ShardingType, rows: int, cols: int
    ) -> ShardCost:
        c, topo = self.constants, self.topology
        v = c.bytes_per_value
        world = topo.world_size
        fraction = rows / stats.num_embeddings
        if sharding is ShardingType.DATA_PARALLEL:
            local = self.batch_size
            ids = stats.lookups(local)
            lookup = ids * (cols * v / self.lookup_bw + c.lookup_s_per_id)
            touched = stats.distinct(local * world)
            update = (local * cols * v + touched * self._row_update_bytes(cols)) / (
                self.update_bw
            ) + touched * c.update_s_per_row
            grad_bytes = 2 * (world - 1) / world * rows * cols * v
            bw = self.cross_bw if topo.hosts > 1 else self.intra_bw
            return ShardCost(lookup, update, 0.0, grad_bytes / bw if world > 1 else 0.0)
        samples = self.batch_size * world
        ids = stats.lookups(samples) * fraction
        lookup = ids * (cols * v / self.lookup_bw + c.lookup_s_per_id)
        touched = stats.distinct(samples, fraction)
        update = (samples * cols * v + touched * self._row_update_bytes(cols)) / (
            self.update_bw
        ) + touched * c.update_s_per_row
        input_comm = self._link_seconds(ids * c.id_bytes)
        output_comm = self._link_seconds(2 * samples * cols * v)
        return ShardCost(lookup, update, input_comm, output_comm)

    # ----------------------------------------------------------- devices
    def device_overhead(self, num_widths: int, num_shards: int) -> float:
        c = self.constants
        return c.kernel_overhead_s * num_widths + c.table_overhead_s * num_shards
