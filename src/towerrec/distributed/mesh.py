"""Topology: a 2-D mesh of hosts x local ranks, from torchrun's environment.

::

                local 0    local 1          rank = host * L + local
    host 0   [ rank 0  |  rank 1 ]  ◄── intra-host group (fast links)
    host 1   [ rank 2  |  rank 3 ]
                 ▲          ▲
                 └─ cross-host peer groups (rank l of every host)

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``; the number of hosts is ``WORLD_SIZE / LOCAL_WORLD_SIZE``
unless overridden (``hosts=H``, ``towerrec train --hosts H``), which lets one
CPU box stand in for H hosts: any byte sent between ranks of different hosts is
counted as cross-host traffic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "HOSTS_ENV",
    "MeshAxis",
    "Topology",
    "init_distributed",
    "new_group",
    "topology_from_env",
]

HOSTS_ENV = "TOWERREC_HOSTS"


class MeshAxis(StrEnum):
    HOST = "host"
    LOCAL = "local"


@dataclass(frozen=True)
class Topology:
    """Where this process sits: ``rank`` of ``world_size`` on ``hosts`` hosts."""

    world_size: int
    hosts: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.hosts < 1 or self.world_size % self.hosts:
            raise ValueError(
                f"world size {self.world_size} is not a positive multiple of hosts {self.hosts}; "
                "choose --hosts H that divides --nproc N"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")

    @property
    def ranks_per_host(self) -> int:
        return self.world_size // self.hosts

    @property
    def host(self) -> int:
        return self.host_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def host_ranks(self, host: int) -> list[int]:
        """Global ranks of ``host``."""
        first = host * self.ranks_per_host
        return list(range(first, first + self.ranks_per_host))

    def is_cross_host(self, other_rank: int) -> bool:
        return self.host_of(other_rank) != self.host


def topology_from_env(hosts: int | None = None) -> Topology:
    """The topology torchrun (or ``towerrec train --nproc``) describes in the environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if hosts is None:
        override = os.environ.get(HOSTS_ENV)
        if override:
            hosts = int(override)
        else:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
            hosts = max(world // max(local_world, 1), 1)
    return Topology(world, hosts, rank)


def init_distributed(
    topology: Topology, device: torch.device, timeout_s: float = 300.0
) -> DeviceMesh:
    """Join the process group (gloo on CPU, NCCL on CUDA) and build the hosts x local mesh.

    ``timeout_s`` bounds how long a collective waits for a missing peer, so a
    rank that died unnoticed makes the others fail instead of hanging forever.
    """
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=_attempt_store(topology, timeout_s),
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    if dist.get_world_size() != topology.world_size:
        raise ValueError(
            f"the process group has {dist.get_world_size()} ranks, the topology "
            f"{topology.world_size}"
        )
    return init_device_mesh(
        device.type,
        (topology.hosts, topology.ranks_per_host),
        mesh_dim_names=(MeshAxis.HOST.value, MeshAxis.LOCAL.value),
    )


def _attempt_store(topology: Topology, timeout_s: float) -> dist.Store | None:
    """Under the elastic launcher, a store private to this restart attempt: the
    workers of an attempt must not find the addresses of the previous (dead) ones."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        topology.world_size,
        is_master=topology.rank == 0 and not agent_store,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"towerrec/attempt_{attempt}", base)


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` whose collectives wait for a peer as long as the world's do
    (``init_distributed``'s ``timeout_s``, ``distributed.timeout_s``): torch gives a new
    group its backend's default instead (30 minutes for gloo), so that a stalled peer
    would hold the others that long."""
    group = dist.new_group(ranks, timeout=_world_timeout(), backend=backend)
    assert group is not None  # this process is one of the ranks (every caller's is)
    return group


def _world_timeout() -> timedelta:
    """The timeout the default process group was started with."""
    world = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    timeout: timedelta = world._get_backend(device).options._timeout
    return timeout
