"""The dense gradients' all-reduce as a DDP communication hook: ``ring`` or ``hierarchical``.

``distributed.dense_allreduce`` picks how DDP averages each gradient bucket (``P``
bytes) over the world of ``N`` hosts x ``L`` ranks::

    ring          one all-reduce over the world (gloo's ring): every rank sends
                  2 (W - 1) / W P to the next rank; the last rank of each host's
                  neighbour is on the next host, so N of the W ranks cross:
                  2 (W - 1) / W P N bytes across hosts per bucket
                  (2 x 2: 3P across, 3P inside)
    hierarchical  (1) reduce-scatter inside the host: rank l receives shard l
                      (P / L) from each host peer and sums them in rank order
                  (2) all-reduce of shard l across hosts, among the ranks of local
                      rank l (one per host): 2 (N - 1) / N P / L per rank
                  (3) all-gather of the shards inside the host
                  across hosts: 2 (N - 1) P per bucket (2 x 2: 2P), inside:
                  2 (L - 1) P N

The hierarchical result is the same on every rank (each shard is summed once,
then copied), so the replicas stay equal; it differs from the ring's in the order
of the sum (float rounding). Its three collectives run one after another inside
the hook (the hook returns a completed future), over process groups of their own
built once (``HierarchicalGroups``): three collectives chained on other threads
could interleave differently on different ranks with the next bucket's. Both
hooks record the bytes this rank sends into a ``CommStats``, per link class:
``dense_allreduce`` (ring); ``dense_reduce_scatter``, ``dense_allreduce_cross``,
``dense_all_gather`` (hierarchical).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from towerrec.distributed.comm import CommStats, ring_allreduce_hook
from towerrec.distributed.mesh import Topology, new_group

__all__ = [
    "DENSE_ALLREDUCE",
    "HierarchicalGroups",
    "dense_allreduce_hook",
    "hierarchical_allreduce_hook",
    "uses_hierarchical",
]

# torch 2.13 renamed all_gather_into_tensor (which now warns on every call); older
# releases have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DENSE_ALLREDUCE = ("ring", "hierarchical")

Hook = Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class HierarchicalGroups:
    """This rank's host group (the L ranks of its host, group rank = local rank) and peer
    group (local rank l of every host, group rank = host), for the dense all-reduce only.
    ``build`` is collective: every rank calls it at the same point."""

    host: dist.ProcessGroup
    peer: dist.ProcessGroup

    @classmethod
    def build(cls, topology: Topology) -> HierarchicalGroups:
        hosts, per_host = topology.hosts, topology.ranks_per_host
        backend = dist.get_backend()
        host = peer = None
        for h in range(hosts):
            group = new_group(topology.host_ranks(h), backend=backend)
            if h == topology.host:
                host = group
        for local in range(per_host):
            group = new_group([h * per_host + local for h in range(hosts)], backend=backend)
            if local == topology.local_rank:
                peer = group
        assert host is not None and peer is not None  # every rank is on one host
        return cls(host, peer)


def uses_hierarchical(kind: str, topology: Topology) -> bool:
    """Whether ``kind`` runs hierarchically on ``topology``: ``hierarchical`` with several
    hosts of several ranks each; on one host (or one rank per host) it is the ring."""
    if kind not in DENSE_ALLREDUCE:
        raise ValueError(
            f"distributed.dense_allreduce = {kind!r}: use one of "
            f"{', '.join(map(repr, DENSE_ALLREDUCE))}"
        )
    return kind == "hierarchical" and topology.hosts > 1 and topology.ranks_per_host > 1


def hierarchical_allreduce_hook(
    topology: Topology, stats: CommStats, groups: HierarchicalGroups
) -> Hook:
    """A DDP communication hook averaging each bucket over the whole world in three steps
    (module doc), its bytes recorded in ``stats`` per step and link class."""
    per_host, hosts, world = topology.ranks_per_host, topology.hosts, topology.world_size
    if hosts < 2 or per_host < 2:
        raise ValueError(
            f"a hierarchical all-reduce needs several hosts of several ranks, got {hosts} "
            f"hosts x {per_host}; use distributed.dense_allreduce = 'ring'"
        )

    # No annotations: DDP checks them at run time, and this module's are strings.
    def hook(_state, bucket):
        buffer = bucket.buffer()
        flat = buffer.view(-1)
        shard = -(-flat.numel() // per_host)
        padded = torch.zeros(shard * per_host, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        item = padded.element_size()
        # (1) reduce-scatter inside the host: shard j of every host rank to rank j
        got = torch.empty_like(padded)
        dist.all_to_all_single(got, padded, group=groups.host)
        stats.record("dense_reduce_scatter", (per_host - 1) * shard * item, 0)
        mine = got.view(per_host, shard).sum(0)
        # (2) that shard summed over the hosts (gloo's ring among hosts)
        dist.all_reduce(mine, group=groups.peer)
        stats.record("dense_allreduce_cross", 0, 2 * (hosts - 1) * shard * item // hosts)
        mine.div_(world)
        # (3) every shard back to every rank of the host
        _all_gather_single(padded, mine, group=groups.host)
        stats.record("dense_all_gather", (per_host - 1) * shard * item, 0)
        flat.copy_(padded[: flat.numel()])
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    return hook


def dense_allreduce_hook(
    kind: str,
    topology: Topology,
    stats: CommStats,
    group: dist.ProcessGroup | None = None,
    groups: HierarchicalGroups | None = None,
) -> Hook:
    """The hook of ``kind`` for a DDP over ``group`` (None: the world). Hierarchical only
    over the world of several hosts (``uses_hierarchical``, with ``groups`` built); a
    DDP over a subgroup (a tower's, inside one host) or one host keeps the ring."""
    if group is None and uses_hierarchical(kind, topology):
        if groups is None:
            raise ValueError("a hierarchical dense all-reduce needs its groups built")
        return hierarchical_allreduce_hook(topology, stats, groups)
    return ring_allreduce_hook(topology, stats, group)
