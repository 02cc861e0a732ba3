"""How one process takes part in a (possibly distributed) training run.

``towerrec train`` in one process: a ``RunContext`` of world size 1, every
method a no-op. Under ``towerrec train --nproc N`` or ``torchrun`` (the
environment names RANK, WORLD_SIZE, ...): the process joins the group, builds
the hosts x local mesh and ``parallelize``s the model by the configured plan;
``train.batch_size`` is the global batch, each rank reading its slice, so the
run follows the single-process one on the same data. Evaluation gathers every
rank's predictions (rank slices of the eval split may differ by a row); the
embedding collectives' bytes are summed over ranks.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from towerrec.build.models import tower_transform
from towerrec.build.planning import build_plan, plan_tower_layouts
from towerrec.config import Config
from towerrec.distributed.block_exchange import GroupExchange
from towerrec.distributed.comm import CommCodecs, CommStats
from towerrec.distributed.dense_allreduce import uses_hierarchical
from towerrec.distributed.id_wire import IdWire
from towerrec.distributed.mesh import Topology, init_distributed, new_group, topology_from_env
from towerrec.distributed.parallelize import comm_stats, parallelize, rebuild_ddp, uniform_plan
from towerrec.distributed.towers import TowerParallelDMT, parallelize_towers, tower_tables
from towerrec.memory import peak_rss_mb
from towerrec.modules.embedding_bag import fused_embedding_modules
from towerrec.modules.interfaces import CachingCollection
from towerrec.modules.table_cache import CacheStats

if TYPE_CHECKING:
    from towerrec.models.dmt import DMT
    from towerrec.modules.embedding_bag import EmbeddingBagCollection

__all__ = ["RunContext", "start_distributed"]

log = logging.getLogger("towerrec")


@dataclass
class RunContext:
    topology: Topology
    mesh: DeviceMesh | None = None
    # Bytes this rank sent in training steps: embedding collectives (intra, cross), then
    # the dense gradient all-reduces (intra, cross); on a resumed run rank 0 starts from
    # the run's totals so far (``restore_train_bytes``).
    train_bytes: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    dense_stats: CommStats = field(default_factory=CommStats)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Collective calls of this rank in this process's training steps, per name (the
    # embedding collectives and the dense all-reduces), and those steps.
    train_calls: dict[str, int] = field(default_factory=dict)
    train_steps: int = 0
    # the planner's in-host layout of each tower (distributed.tower_sharding = "auto")
    tower_layouts: list[dict[str, Any]] | None = None
    _calls_before: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def stop_agreed(self, requested: bool) -> bool:
        """Whether any rank asked to stop after this step (a signal reaches one process,
        not all): one all-reduce MAX of a 0/1 flag, so every rank stops after the same
        step and they write one checkpoint together."""
        if self.world_size == 1:
            return requested
        flag = torch.tensor([int(requested)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def all_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one all-reduce MIN of a 0/1 flag), for a
        choice each rank makes from its own machine that the ranks must share."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def local_batch(self, global_batch: int, what: str = "train.batch_size") -> int:
        if global_batch % self.world_size:
            raise ValueError(
                f"{what} = {global_batch} is the global batch and must divide evenly over "
                f"{self.world_size} ranks; choose a multiple of {self.world_size}"
            )
        return global_batch // self.world_size

    def parallelize(self, model: nn.Module, config: Config, source) -> nn.Module:
        """Shard ``model`` by ``plan.strategy``: the planner (``auto``), a plan file
        (``file``), or every table by ``distributed.sharding`` (``none``)."""
        if self.world_size == 1:
            return model
        settings = config.distributed
        if (
            settings.dense_allreduce == "hierarchical"
            and not uses_hierarchical(settings.dense_allreduce, self.topology)
            and self.is_main
        ):
            log.info(
                "distributed.dense_allreduce = hierarchical needs several hosts of several "
                "ranks; %d hosts x %d ranks: the dense gradients are all-reduced by the ring",
                self.topology.hosts,
                self.topology.ranks_per_host,
            )
        if tower_transform(config, self.topology):
            if config.optimizer.draws_samples:
                raise ValueError(
                    f"optimizer.name = {config.optimizer.name!r} is not supported under the "
                    "tower transform (a DMT on several hosts); use adam, adagrad, sgd or "
                    "shampoo, or run on one host"
                )
            return self._parallelize_towers(model, config, source)
        if config.plan.hosts not in (1, self.topology.hosts):
            log.warning(
                "plan.hosts = %d but the run has %d hosts; planning for the run's",
                config.plan.hosts,
                self.topology.hosts,
            )
        # What gets sharded: the storage tables (a compressed table's smaller tables).
        storage = [t for _, m in fused_embedding_modules(model) for t in m.tables]
        stored = sorted(t.name for t in storage)
        if config.plan.strategy != "none" and stored != sorted(
            f.name for f in source.schema.sparse
        ):
            raise ValueError(
                f"plan.strategy = {config.plan.strategy!r} plans the data's tables, but "
                f"compressed tables (embedding.kind, embedding.tables) are stored as {stored}; "
                "use plan.strategy = 'none' to shard those by distributed.sharding"
            )
        run_plan = replace(config.plan, hosts=self.topology.hosts, ranks_per_host=0)
        plan = build_plan(replace(config, plan=run_plan), source, self.world_size)
        if plan is None:
            plan = uniform_plan(storage, self.topology, settings.sharding)
        elif self.is_main:
            kinds = Counter(tp.sharding.value for tp in plan.tables.values())
            log.info("plan.strategy = %s: %s", config.plan.strategy, dict(kinds))
        codecs = CommCodecs(settings.forward_codec, settings.backward_codec)  # type: ignore[arg-type]  # parsed in __post_init__
        assert self.mesh is not None  # set for every distributed run
        return parallelize(
            model,
            self.mesh,
            plan,
            codecs=codecs,
            dense_stats=self.dense_stats,
            dense=settings.dense,
            reshard_after_forward=settings.reshard_after_forward,
            id_wire=IdWire(settings.dedup_ids),
            replicate_dense=not config.optimizer.draws_samples,
            dense_allreduce=settings.dense_allreduce,
        )

    def block_exchange(self, model: nn.Module) -> tuple[GroupExchange | None, list[nn.Parameter]]:
        """For a distributed Shampoo: an exchange over every rank (a process group of its
        own, so its all-gather never interleaves with other collectives) and the dense
        parameters replicated over fewer ranks (a tower's, under the tower transform),
        which each rank preconditions itself. One process: no exchange. Every rank
        calls this at the same point (it makes a process group)."""
        if self.world_size == 1:
            return None, []
        local = list(model.tower.parameters()) if isinstance(model, TowerParallelDMT) else []
        return GroupExchange(new_group()), local

    def _parallelize_towers(self, model: nn.Module, config: Config, source) -> nn.Module:
        """A DMT on several hosts: the tower transform, tower t on host t
        (``distributed/towers.py``); its tables laid out inside host t as
        ``distributed.tower_sharding`` says, or by the planner's cost model (``auto``)."""
        settings = config.distributed
        if settings.pipeline:
            raise ValueError(
                "distributed.pipeline does not apply to model.name = 'dmt' on several hosts "
                "(the tower transform routes ids itself); set distributed.pipeline = false"
            )
        if config.plan.strategy != "none" and self.is_main:
            log.warning(
                "plan.strategy = %s is ignored by the tower transform: tower t's tables are "
                "laid out inside host t by distributed.tower_sharding = %s",
                config.plan.strategy,
                settings.tower_sharding,
            )
        codecs = CommCodecs(settings.forward_codec, settings.backward_codec)  # type: ignore[arg-type]  # parsed in __post_init__
        assert self.mesh is not None  # set for every distributed run
        dmt = cast("DMT", model)
        sharding, placement = settings.tower_sharding, None
        if sharding == "auto":
            ebc = cast("EmbeddingBagCollection", dmt.sparse)
            towers = [tower_tables(ebc, group, t) for t, group in enumerate(dmt.partition)]
            layouts = plan_tower_layouts(config, source, towers, self.topology.ranks_per_host)
            self.tower_layouts = [layout.as_dict() for layout in layouts]
            mine = layouts[self.topology.host]
            sharding, placement = mine.sharding.value, mine.ranks
            if self.is_main:
                for t, layout in enumerate(layouts):
                    log.info(
                        "tower %d: tables %s inside host %d (planner: slowest rank %s, "
                        "imbalance %.2f)",
                        t,
                        layout.sharding.value,
                        t,
                        ", ".join(f"{k} {1e3 * v:.3g} ms" for k, v in layout.seconds.items()),
                        layout.imbalance,
                    )
        tower_codec = settings.tower_codec
        parallel = parallelize_towers(
            dmt,
            self.mesh,
            sharding=sharding,
            codecs=codecs,
            tower_codecs=CommCodecs(tower_codec, tower_codec),  # type: ignore[arg-type]  # parsed in __post_init__
            dense_stats=self.dense_stats,
            dense=settings.dense,
            id_wire=IdWire(settings.dedup_ids),
            placement=placement,
            dense_allreduce=settings.dense_allreduce,
        )
        if self.is_main:
            log.info(
                "tower transform: %d towers on %d hosts x %d ranks, tables %s inside each host, "
                "tower outputs in %s across hosts",
                self.topology.hosts,
                self.topology.hosts,
                self.topology.ranks_per_host,
                "as the planner chose (above)"
                if settings.tower_sharding == "auto"
                else settings.tower_sharding,
                tower_codec,
            )
        return parallel

    def rebuild_dense_replicas(self, model: nn.Module) -> None:
        """After dense parameters changed shape (``train.prune_grow``): DDP anew."""
        if self.world_size > 1:
            rebuild_ddp(model)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation over ranks of 1-D tensors, in rank order; their lengths may
        differ (an eval split that does not divide evenly over the ranks)."""
        if self.world_size == 1:
            return x
        size = torch.tensor([x.numel()], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        lengths = [int(s) for s in sizes]
        padded = x.new_zeros(max(lengths))  # all_gather wants equal shapes: pad, then trim
        padded[: x.numel()] = x
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:n] for part, n in zip(parts, lengths, strict=True)])

    def cache_stats(self, model: nn.Module) -> dict[str, CacheStats]:
        """The counts of the model's cached tables by table, summed over the ranks (a
        collective: every rank calls it); empty when no table runs cached."""
        local: dict[str, list[int]] = {}
        for module in model.modules():
            if isinstance(module, CachingCollection):
                for name, stats in module.cache_stats().items():
                    counts = local.setdefault(name, [0] * len(CacheStats.FIELDS))
                    local[name] = [a + b for a, b in zip(counts, stats.counts(), strict=True)]
        if self.world_size > 1:
            gathered: list[dict[str, list[int]]] = [{} for _ in range(self.world_size)]
            dist.all_gather_object(gathered, local)
            local = {}
            for part in gathered:
                for name, counts in part.items():
                    total = local.setdefault(name, [0] * len(CacheStats.FIELDS))
                    local[name] = [a + b for a, b in zip(total, counts, strict=True)]
        return {name: CacheStats.from_counts(local[name]) for name in sorted(local)}

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (a collective: every rank must call it)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def comm_snapshot(self, model: nn.Module) -> tuple[int, int, int, int]:
        """Bytes this rank has sent: embedding collectives, then dense all-reduces
        (intra-host, cross-host each)."""
        if self.world_size == 1:
            return (0, 0, 0, 0)
        self._calls_before = self._calls(model)
        return (*comm_stats(model).snapshot(), *self.dense_stats.snapshot())

    def _calls(self, model: nn.Module) -> dict[str, int]:
        return {**comm_stats(model).calls, **self.dense_stats.calls}

    def count_train_bytes(self, model: nn.Module, before: tuple[int, ...]) -> None:
        """Add the bytes sent since ``before`` (a training step's) to the training totals,
        and the collective calls since that snapshot to ``train_calls``.
        A pipelined batch's input collectives count here too: they are recorded when
        the batch is trained, not when its prefetch starts."""
        calls_before = self._calls_before
        after = self.comm_snapshot(model)
        for i, (a, b) in enumerate(zip(after, before)):
            self.train_bytes[i] += a - b
        if self.world_size > 1:
            for name, calls in self._calls_before.items():
                step = calls - calls_before.get(name, 0)
                if step:
                    self.train_calls[name] = self.train_calls.get(name, 0) + step
            self.train_steps += 1

    def run_train_bytes(self) -> list[float]:
        """The whole run's training bytes over all ranks (a collective: every rank calls
        it), as saved with a checkpoint."""
        totals = torch.tensor(self.train_bytes, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(totals)
        return totals.tolist()

    def restore_train_bytes(self, totals: list[float]) -> None:
        """Continue the counts of a resumed run: rank 0 holds the totals so far."""
        if len(totals) == len(self.train_bytes) and self.rank == 0:
            self.train_bytes = [int(x) for x in totals]

    def comm_per_sample(self, samples: int) -> dict[str, Any]:
        """Bytes all ranks sent in training steps per (global) training sample: the
        embedding collectives, the dense gradient all-reduces, and their total, per link
        class."""
        if self.world_size == 1:
            return {}
        emb_intra, emb_cross, dense_intra, dense_cross = (
            x / max(samples, 1) for x in self.run_train_bytes()
        )
        return {
            "world_size": self.world_size,
            "hosts": self.topology.hosts,
            "comm_bytes_per_sample_intra": emb_intra,
            "comm_bytes_per_sample_cross": emb_cross,
            "dense_allreduce_bytes_per_sample_intra": dense_intra,
            "dense_allreduce_bytes_per_sample_cross": dense_cross,
            "total_bytes_per_sample_intra": emb_intra + dense_intra,
            "total_bytes_per_sample_cross": emb_cross + dense_cross,
            **({"tower_layouts": self.tower_layouts} if self.tower_layouts else {}),
            # rank 0's collective calls per training step of this process, per name
            "comm_calls_per_step": {
                name: calls / max(self.train_steps, 1)
                for name, calls in sorted(self.train_calls.items())
            },
        }

    def memory_summary(self) -> dict[str, Any]:
        """Peak resident memory (MiB): this process's, or the max and every rank's."""
        peak = peak_rss_mb()
        if self.world_size == 1:
            return {"peak_rss_mb": round(peak, 1)}
        per_rank = self.gather(torch.tensor([peak], dtype=torch.float64)).tolist()
        return {
            "peak_rss_mb": round(max(per_rank), 1),
            "peak_rss_mb_per_rank": [round(x, 1) for x in per_rank],
        }


def start_distributed(config: Config, device: torch.device, hosts: int | None = None) -> RunContext:
    """Join the run the environment describes (world size 1 when there is none); ``hosts``
    (``towerrec train --hosts`` under torchrun) overrides the hosts it implies."""
    topology = topology_from_env(hosts)
    if topology.world_size == 1:
        return RunContext(topology)
    mesh = init_distributed(topology, device, timeout_s=config.distributed.timeout_s)
    if topology.rank != 0:  # rank 0 speaks for the run
        log.setLevel(logging.WARNING)
    return RunContext(topology, mesh, device=device)
