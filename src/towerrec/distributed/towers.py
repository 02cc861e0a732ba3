"""Semantic-preserving tower transform (SPTT): a DMT over N hosts x L ranks, tower t on host t.

::

    rank (h, l): local batch B_{h,l}            (h: host, l: local rank; N hosts, L ranks each)
      dense ─► bottom MLP ─► x [B, D] ─────────────────────────────────────────────┐
      sparse KJT (all features)                                                     │
        │ split by tower: tower t's features ─► peer (t, l)                         │
        ▼ (a) peer all-to-all across hosts, rank l <-> rank l only: one message per │
        │     peer, lengths + ids + per-id weights (narrow types, deduplicated:     │
        │     id_wire.py); x with tower_dense (bottom run first)                    │
    rank (t, l): tower t's features of the peer batch P = sum_h B_{h,l}             │
        ▼ (b) host-local sharded lookup of tower t's tables (row-wise, ... inside   │
        │     host t: ShardedEmbeddingBagCollection on the host's L ranks)          │
      E_t [P, T_t, D] ─► (c) tower t (DDP over the L ranks of host t) ─► O_t [P, K_t, D]
        ▼ (d) peer all-to-all back: each sample's O_t to the rank that owns it,     │
        │     in flight while the bottom MLP runs (its gradient: while the bottom's │
        │     backward and the dense all-reduce run)                                │
    rank (h, l): O_0 .. O_{N-1} [B, K_t, D], in tower order ─► interact(x, O) ◄─────┘
                                                                ─► logits [B]

Bottom MLP, interaction and top run data-parallel over the whole world (DDP);
only tower t's module and tables exist on host t. With ``tower_dense`` the
bottom output x follows the ids in (a) once the bottom has run (differentiably).
The step's collectives of the transform: the ids (one message per peer, and a
second for payloads over the agreed capacity: ``sized_exchange.py``), x (with
``tower_dense``), the host lookup's, the tower outputs. Every collective
is counted by ``CommStats``: the peer all-to-alls as cross-host bytes, the
lookup's as intra-host bytes (one stats object for the whole model).

Gradient scaling. Each rank's loss is the mean over its B samples and DDP
averages, so the run follows the single-process model on the global batch of
G = N L B samples when every parameter's gradient is ``(1/NL) sum_r grad loss_r``:

- bottom, top: DDP over the N L ranks averages: ``1/NL`` as in the flat model;
- tower t on rank (t, l) sees the gradients of the N peers' losses (its peer
  batch); the returned outputs' gradients are scaled by ``1/N`` and DDP over
  the host's L ranks averages: ``1/NL``;
- tower t's tables get the same ``1/N`` and the host collection's
  ``grad_scale = 1/L``: ``1/NL``, as the flat sharded collection's ``1/world``;
- x sent to the towers (``tower_dense``): its gradient from the tower is
  scaled back by ``N`` so that the owner's x receives the unscaled gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from towerrec.distributed.comm import Comm, CommCodecs, CommStats, Pending
from towerrec.distributed.embedding_bag import ScaleGrad, ShardedEmbeddingBagCollection
from towerrec.distributed.fsdp import apply_fsdp, dense_mesh
from towerrec.distributed.id_wire import IdWire
from towerrec.distributed.input_dist import assemble
from towerrec.distributed.lookup import copy_tables
from towerrec.distributed.mesh import Topology, new_group
from towerrec.distributed.parallelize import (
    check_dense_allreduce,
    dense_groups,
    replicate_counted,
    topology_of,
    uniform_plan,
)
from towerrec.distributed.sized_exchange import SizedExchange, SizedFlight
from towerrec.models.dmt import DMT, TowerModule
from towerrec.models.interfaces import SparseArchModel
from towerrec.modules.embedding_bag import EmbeddingBagCollection, dense_parameters
from towerrec.modules.tables import TableConfig
from towerrec.sharding import TOWER_SHARDINGS, ShardingPlan, ShardingType, plan_table
from towerrec.sparse import KeyedJaggedTensor

__all__ = [
    "TOWER_SHARDINGS",
    "TowerParallelDMT",
    "parallelize_towers",
    "tower_groups",
    "tower_tables",
]


def tower_groups(
    topology: Topology,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (peer group, host group, host group for DDP).

    Every rank creates every group in the same order (``new_group`` is
    collective): the peer group of local rank l holds rank l of each host
    (group rank = host), a host group the L ranks of one host (group rank =
    local rank). The tower's DDP gets a host group of its own, so the
    transform's all-to-alls never interleave with DDP's all-reduces.
    """
    hosts, per_host = topology.hosts, topology.ranks_per_host
    backend = dist.get_backend()
    peer = None
    for local in range(per_host):
        group = new_group([h * per_host + local for h in range(hosts)], backend=backend)
        if local == topology.local_rank:
            peer = group
    host = []
    for _ in range(2):
        for h in range(hosts):
            group = new_group(topology.host_ranks(h), backend=backend)
            if h == topology.host:
                host.append(group)
    assert peer is not None  # every rank is local rank l of its host for one l
    return peer, host[0], host[1]


def _scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ScaleGrad.apply(x, scale) if x.requires_grad and scale != 1.0 else x


class TowerEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """Tower t's tables sharded over host t; counts every tower's tables as the model's."""

    def __init__(self, *args, total_embedding_parameters: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.total_embedding_parameters = total_embedding_parameters

    @property
    def num_embedding_parameters(self) -> int:
        return self.total_embedding_parameters

    def read_rows_ahead(self, on: bool) -> bool:
        """Never: the tower transform routes ids itself, without the pipeline."""
        self.prefetch_rows = False
        return False


class TowerParallelDMT(SparseArchModel):
    """The DMT of this rank under SPTT (module doc); ``forward(dense [B, F], sparse) -> [B]``.

    Made by ``parallelize_towers`` on every rank. Parameter and state-dict names
    are the single-device DMT's (``bottom.*``, ``towers.<t>.*``, ``top.*``,
    ``sparse.embedding_bags.<table>.*``): host t holds tower t only.
    """

    tower_order: torch.Tensor  # a buffer: this tower's features' places in the lookup

    def __init__(
        self,
        model: DMT,
        topology: Topology,
        sparse: ShardedEmbeddingBagCollection,
        peer: Comm,
        tower_codecs: CommCodecs,
        wire: IdWire | None = None,
    ) -> None:
        super().__init__()
        # the codecs of the floats that cross hosts: tower outputs, x and their gradients
        self.topology, self.peer, self.tower_codecs = topology, peer, tower_codecs
        self.wire = wire or IdWire()
        # the ids' peer exchange: one message per peer once sizes settle
        self.peer_ids = SizedExchange(peer, "tower_input_ids", "tower_input_overflow")
        self.tower_index = topology.host
        self.partition = [list(g) for g in model.partition]
        self.embedding_dim = model.embedding_dim
        self.num_outputs = [t.num_outputs for t in cast("Iterable[TowerModule]", model.towers)]
        # The DMT's own top (its interaction and top are this module's, shared).
        self._interact: Callable[[torch.Tensor | None, Sequence[torch.Tensor]], torch.Tensor]
        self._interact = model.interact
        self.use_dense = model.towers[self.tower_index].use_dense
        self._flops = model.flops_per_sample()
        self._num_dense = sum(p.numel() for _, p in dense_parameters(model))
        self.bottom = model.bottom
        self.sparse = sparse
        self.towers = nn.ModuleDict({str(self.tower_index): model.towers[self.tower_index]})
        self.interaction = model.interaction
        self.top = model.top
        group = self.partition[self.tower_index]
        position = {f: i for i, f in enumerate(sparse.feature_names)}
        order = [position[f] for f in group]
        self.register_buffer("tower_order", torch.tensor(order), persistent=False)

    @property
    def tower(self) -> nn.Module:
        return self.towers[str(self.tower_index)]

    def flops_per_sample(self) -> int:
        """The single-device DMT's forward FLOPs per sample (the transform adds none)."""
        return self._flops

    def num_dense_parameters(self) -> int:
        """Dense parameters of the whole model (every host's tower), not of this rank."""
        return self._num_dense

    # ------------------------------------------------------------- (a) input
    def input_dist_start(self, features: KeyedJaggedTensor) -> SizedFlight:
        """Start sending each tower's features to its host: one message per peer once the
        payload sizes settle (``sized_exchange.py``), the payload of ids, lengths and
        per-id weights (``id_wire.py``). ``input_dist_batches`` then gives ``B_h`` per host
        and ``input_dist_finish`` the features of the peer batch."""
        batch = features.stride()
        weights = features.weights_or_none()
        payloads = []
        for group in self.partition:
            part = features.select(group)
            payloads.append(
                self.wire.encode(
                    part.lengths().view(len(group), batch),
                    part.values(),
                    part.weights() if weights is not None else None,
                )
            )
        fields = [[batch, int(weights is not None)]] * len(payloads)
        return self.peer_ids.start(payloads, fields)

    def input_dist_batches(self, flight: SizedFlight) -> list[int]:
        """``B_h`` per host of an input exchange: waits for its chunks (and starts the
        overflow all-to-all where a payload did not fit)."""
        head = flight.heads()
        weighted = head[:, 1]
        if bool(weighted.any()) != bool(weighted.all()):
            raise ValueError(
                "some ranks' batches carry per-id weights and some do not; give every rank "
                "weighted features or none"
            )
        return head[:, 0].tolist()

    def input_dist_finish(self, flight: SizedFlight) -> KeyedJaggedTensor:
        """Tower t's features of the peer batch ``[sum_h B_h]`` from an input exchange."""
        batches = self.input_dist_batches(flight)
        keys = self.partition[self.tower_index]
        parts, got_weights = self.wire.decode_all_weighted(
            torch.cat(flight.received()), flight.sizes, len(keys), batches
        )
        return assemble(keys, parts, got_weights)

    def dense_dist(self, x: torch.Tensor, batches: Sequence[int]) -> torch.Tensor:
        """x ``[B, D]`` to the towers' hosts (``tower_dense``): x of the peer batch
        ``[sum_h B_h, D]``, differentiable."""
        hosts, batch, dim = self.topology.hosts, x.shape[0], x.shape[1]
        flat = x.reshape(-1).repeat(hosts) if hosts > 1 else x.reshape(-1)
        got = self.peer.all_to_all(
            flat,
            [batch * dim] * hosts,
            [b * dim for b in batches],
            "tower_dense",
            self.tower_codecs,
        )
        return _scale_grad(got.view(-1, dim), float(hosts))

    def input_dist(
        self, features: KeyedJaggedTensor, x: torch.Tensor | None
    ) -> tuple[KeyedJaggedTensor, torch.Tensor | None, list[int]]:
        """Send each tower's features (and x) to its host: tower t's features of the peer
        batch ``[sum_h B_h]``, x of the peer batch ``[sum_h B_h, D]``, and ``B_h`` per host
        (``input_dist_start``, then ``dense_dist``, without compute between them)."""
        flight = self.input_dist_start(features)
        batches = self.input_dist_batches(flight)
        x_peer = self._peer_dense(x, batches)
        return self.input_dist_finish(flight), x_peer, batches

    def _peer_dense(self, x: torch.Tensor | None, batches: Sequence[int]) -> torch.Tensor | None:
        """The peer batch's x under ``tower_dense`` (``dense_dist``), else None."""
        if not self.use_dense:
            return None
        if x is None:
            raise ValueError("tower_dense needs the bottom output x")
        return self.dense_dist(x, batches)

    # ------------------------------------------------------------ (d) output
    def output_dist(self, out: torch.Tensor, batches: Sequence[int]) -> list[torch.Tensor]:
        """Tower outputs ``[sum_h B_h, K_t, D]`` -> every tower's ``[B, K_u, D]`` for our samples."""
        return self.output_dist_start(out, batches).wait()

    def output_dist_start(self, out: torch.Tensor, batches: Sequence[int]) -> Pending:
        """``output_dist`` begun: ``.wait()`` gives its result. In the backward the outputs'
        gradients fly while what ran between start and wait runs (``Comm.all_to_all_start``)."""
        batch, dim = batches[self.topology.host], self.embedding_dim
        width = out.shape[1] * dim
        in_flight = self.peer.all_to_all_start(
            out.reshape(-1),
            [b * width for b in batches],
            [batch * k * dim for k in self.num_outputs],
            "tower_outputs",
            self.tower_codecs,
        )

        def finish() -> list[torch.Tensor]:
            parts = in_flight.wait().split([batch * k * dim for k in self.num_outputs])
            return [p.view(batch, k, dim) for p, k in zip(parts, self.num_outputs)]

        return Pending(None, finish)

    def interact(self, x: torch.Tensor | None, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """``DMT.interact``: x ``[B, D]`` (or None) and every tower's ``[B, K_t, D]`` -> ``[B]``."""
        return self._interact(x, outputs)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        flight = self.input_dist_start(sparse)
        # With tower_dense the towers need x: the bottom MLP runs while the ids fly.
        # Else it runs while the tower outputs fly, and in the backward (last created,
        # first run) the bottom's backward and the dense all-reduce run while the
        # outputs' gradients fly back.
        x = self.bottom(dense) if self.bottom is not None and self.use_dense else None
        batches = self.input_dist_batches(flight)
        x_peer = self._peer_dense(x, batches)
        local = self.input_dist_finish(flight)
        embeddings = self.sparse(local).stacked().index_select(1, self.tower_order)
        out = self.tower(embeddings, x_peer)  # [sum_h B_h, K_t, D]
        out = _scale_grad(out, 1.0 / self.topology.hosts)
        outputs = self.output_dist_start(out, batches)
        if self.bottom is not None and not self.use_dense:
            x = self.bottom(dense)
        return self.interact(x, outputs.wait())


def tower_tables(
    ebc: EmbeddingBagCollection, group: Sequence[str], tower: int
) -> list[TableConfig]:
    """Tower ``tower``'s tables, in the order their features first appear in ``group``."""
    chosen: list[TableConfig] = []
    for name in group:
        table = next(t for t in ebc.tables if name in t.feature_names)
        if table in chosen:
            continue
        others = [f for f in table.feature_names if f not in group]
        if others:
            raise ValueError(
                f"table {table.name!r} serves features {list(table.feature_names)} but only "
                f"{[f for f in table.feature_names if f in group]} are in tower {tower}; put all "
                "features of a table in one tower (model.dmt.partition)"
            )
        chosen.append(table)
    return chosen


def check_towers(model: nn.Module, topology: Topology) -> None:
    """Raise ``ValueError`` unless ``model`` can run under SPTT on ``topology``."""
    if not isinstance(model, DMT):
        raise ValueError(
            f"the tower transform needs a DMT model, got {type(model).__name__}; "
            "set model.name = 'dmt'"
        )
    if len(model.towers) != topology.hosts:
        raise ValueError(
            f"model.dmt.num_towers = {len(model.towers)} but the run has {topology.hosts} hosts; "
            f"the tower transform runs one tower per host: set model.dmt.num_towers = "
            f"{topology.hosts} (or run on --hosts {len(model.towers)})"
        )
    if not isinstance(model.sparse, EmbeddingBagCollection):
        raise ValueError(
            f"the tower transform shards full embedding tables, but the model's are "
            f"{type(model.sparse).__name__}; use embedding.kind = 'full' with model.name = 'dmt' "
            "on several hosts"
        )


def parallelize_towers(
    model: DMT,
    mesh: DeviceMesh,
    *,
    sharding: ShardingType | str = ShardingType.ROW_WISE,
    codecs: CommCodecs | None = None,
    tower_codecs: CommCodecs | None = None,
    stats: CommStats | None = None,
    dense_stats: CommStats | None = None,
    dense: str = "ddp",
    id_wire: IdWire | None = None,
    placement: Mapping[str, Sequence[int]] | None = None,
    dense_allreduce: str = "ring",
) -> TowerParallelDMT:
    """Apply SPTT to ``model`` (identical on every rank) on the (host, local) ``mesh``.

    Tower t's tables are sharded over host t's ranks as ``sharding`` (one of
    ``TOWER_SHARDINGS``), on the host-local ranks ``placement`` gives per table where
    given (the planner's layout, ``train.planning.plan_tower_layouts``); weights and optimizer state are copied from ``model``
    (or, when its collection is not materialized, the shards initialise themselves).
    ``dense``: the bottom, top and tower replicated (``"ddp"``) or sharded (``"fsdp"``).
    ``tower_codecs`` encode what crosses hosts as floats, the tower outputs, x and their
    gradients (default fp32: exactly the single-process DMT; ``towerrec train`` passes
    ``distributed.tower_codec``, bf16 by default), ``codecs`` the host lookup's pooled rows
    inside the host; ``id_wire`` the ids of the peer and host all-to-alls.
    ``dense_allreduce``: the bottom's and top's DDP all-reduce over all ranks, ``ring`` or
    ``hierarchical`` (``dense_allreduce.py``); the tower's, inside its host, is the ring.
    """
    topology = topology_of(mesh)
    check_towers(model, topology)
    check_dense_allreduce(dense, dense_allreduce)
    if sharding not in TOWER_SHARDINGS:
        raise ValueError(
            f"distributed.tower_sharding = {str(sharding)!r}: a tower's tables are sharded "
            f"inside its host; use one of {', '.join(repr(t.value) for t in TOWER_SHARDINGS)}"
        )
    codecs = codecs or CommCodecs()
    stats = stats if stats is not None else CommStats()
    hosts, per_host = topology.hosts, topology.ranks_per_host
    peer_group, host_group, ddp_group = tower_groups(topology)
    peer = Comm(Topology(hosts, hosts, topology.host), peer_group, stats)
    host = Comm(Topology(per_host, 1, topology.local_rank), host_group, stats)
    ebc = cast(EmbeddingBagCollection, model.sparse)
    group = model.partition[topology.host]
    tables = tower_tables(ebc, group, topology.host)
    for t, other in enumerate(model.partition):
        if t != topology.host:
            tower_tables(ebc, other, t)  # the same error on every rank
    # Unmaterialized when ``ebc`` is: the host's shards initialise themselves from the seed.
    tower_ebc = copy_tables(ebc, tables)
    if placement is None:
        host_plan = uniform_plan(tables, host.topology, sharding)
    else:
        missing = [t.name for t in tables if t.name not in placement]
        if missing:
            raise ValueError(
                f"the placement of tower {topology.host}'s tables lacks {missing}; give "
                "every table of the tower its host-local ranks"
            )
        host_plan = ShardingPlan(
            per_host, 1, {t.name: plan_table(t, sharding, placement[t.name]) for t in tables}
        )
    sparse = TowerEmbeddingBagCollection(
        tower_ebc,
        host_plan,
        host,
        codecs=codecs,
        grad_scale=1.0 / per_host,
        id_wire=id_wire,
        total_embedding_parameters=ebc.num_embedding_parameters,
    )
    parallel = TowerParallelDMT(
        model, topology, sparse, peer, tower_codecs or CommCodecs(), id_wire
    )
    if topology.world_size > 1 and dense == "fsdp":
        # Bottom and top sharded over every rank, the tower over its host's ranks; each
        # of them is its own FSDP root (TowerParallelDMT's forward is not one module's).
        world = dense_mesh(mesh)
        for module in (m for m in (parallel.bottom, parallel.top) if m is not None):
            apply_fsdp(module, world, per_layer=False)  # an MLP: one unit
        if per_host > 1 and any(True for _ in parallel.tower.parameters()):
            apply_fsdp(parallel.tower, dense_mesh(mesh, ddp_group), per_layer=False)
    elif topology.world_size > 1:
        groups = dense_groups(topology, dense_allreduce)
        # Bottom and top in one DDP over every rank (one gradient all-reduce a step, not
        # one per module); the tables and this host's tower are left to their own groups.
        replicate_counted(
            parallel,
            topology,
            dense_stats,
            dense_allreduce=dense_allreduce,
            groups=groups,
            ignored_modules=[parallel.get_submodule("sparse"), parallel.towers],
        )
        if per_host > 1 and any(True for _ in parallel.tower.parameters()):
            replicate_counted(parallel.tower, topology, dense_stats, ddp_group)
    return parallel
