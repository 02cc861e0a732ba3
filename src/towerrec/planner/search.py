"""The planners by name: one ``Planner`` entry each in ``PLANNERS``, and ``plan``.

::

    PlanRequest(stats, model, constraints, seed, ...)      what to plan, and the settings
        │                                                  the planners read
        ▼  PLANNERS[name].prepare    (optional) load what the planner needs (weights)
        ▼  PLANNERS[name].place      place the shards of a split; while a table does not
        │                            pack, split it (row-wise, else column-wise) and again
        ▼  PLANNERS[name].improve    (optional) search from the split that packs
    PlanResult(plan, device costs, memory, shards)

    greedy_<key>   sort by a proxy (size, lookups, size x lookups, dim; random order),
    random         put each table on the device with the least proxy so far (seed)
    lpt            sort by modelled cost, put each shard where the device cost grows least,
                   then refine: moves and swaps between the most and least loaded devices
    search         LPT + refine, then beam search over column / row splits of the tables
                   on the most loaded device (each candidate scored by LPT); the better wins
    neuroshard     pre-trained neural cost models (planner/neuroshard.py) and their search:
                   beam over column splits x greedy grid over placement
                   (planner/neuroshard_search.py); LPT only finds the splits that pack
    dreamshard     learned policies (planner/dreamshard.py, planner/autoshard.py) with
    autoshard      their shipped weights (or ``weights``): one shard at a time, greedy

The algorithms are in ``planner/algorithms.py``; a new planner is one ``register``
call below. Memory is a hard constraint in every planner; an infeasible task raises
``PlanningError`` naming the table and the shortfall. Everything here is
deterministic for a given seed, so every rank computes the same plan (or the same
error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from towerrec.modules.tables import TableConfig
from towerrec.planner.algorithms import (
    GREEDY_KEYS,
    BeamSettings,
    Splits,
    beam_search,
    greedy,
    lpt,
    place_learned,
    refine,
    split_until_packed,
)
from towerrec.planner.cost import CostModel
from towerrec.planner.learned_planners import LEARNED_PLANNERS
from towerrec.planner.neuroshard import NeuroShardPolicy, load_policy
from towerrec.planner.neuroshard_search import search_neuroshard
from towerrec.planner.placement import Item, Loads, TableConstraint, build_items
from towerrec.planner.stats import TableStats
from towerrec.sharding import Shard, ShardingPlan, ShardingType, TablePlan

__all__ = [
    "GREEDY_KEYS",
    "PLANNERS",
    "BeamSettings",
    "PlanRequest",
    "PlanResult",
    "Planner",
    "evaluate_plan",
    "get_planner",
    "plan_tables",
    "register",
]

log = logging.getLogger("towerrec")


@dataclass(frozen=True)
class PlanRequest:
    """One planning task: the tables' statistics, the cost model (its topology, batch
    size per rank and constants), constraints per table, and the settings the planners
    read (each reads the ones it names)."""

    stats: Sequence[TableStats]
    model: CostModel
    constraints: Mapping[str, TableConstraint] = field(default_factory=dict)
    seed: int = 0  # random: the order and the devices drawn
    refine_rounds: int = 2000  # lpt, search: local-search rounds at most
    beam: BeamSettings = field(default_factory=BeamSettings)  # search, neuroshard
    weights: str | None = None  # neuroshard, dreamshard, autoshard: a file (None: shipped)
    policy: NeuroShardPolicy | None = None  # neuroshard: its cost models already loaded
    kernel: str = "auto"  # neuroshard: the embedding kernel the plan's run uses (a check)

    def __post_init__(self) -> None:
        if not self.stats:
            raise ValueError("nothing to plan: no tables")
        names = [s.name for s in self.stats]
        if len(set(names)) != len(names):
            raise ValueError("table names must be unique")
        object.__setattr__(self, "stats", tuple(self.stats))
        object.__setattr__(self, "constraints", dict(self.constraints))


@dataclass
class PlanResult:
    """A plan and what the cost model says about it, device by device."""

    plan: ShardingPlan
    planner: str
    device_costs: list[float]
    device_memory: list[float]
    device_shards: list[list[str]]
    seconds: float  # wall-clock planning time
    cpu_seconds: float = 0.0  # this process's CPU time for planning (steady on a shared CPU)

    @property
    def max_cost(self) -> float:
        return max(self.device_costs)

    @property
    def mean_cost(self) -> float:
        return sum(self.device_costs) / len(self.device_costs)

    @property
    def imbalance(self) -> float:
        """max / mean device cost (1.0 = perfectly balanced)."""
        return self.max_cost / self.mean_cost if self.mean_cost > 0 else 1.0

    def summary(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "max_cost_ms": self.max_cost * 1e3,
            "mean_cost_ms": self.mean_cost * 1e3,
            "imbalance": self.imbalance,
            "max_memory_gib": max(self.device_memory) / (1 << 30),
            "planning_s": self.seconds,
            "planning_cpu_s": self.cpu_seconds,
        }


Placed = tuple[list[Item], Loads]
Place = Callable[[PlanRequest, list[Item], Loads], None]


class Placing:
    """A planner's placing of a request's tables under given splits; ``cache`` keeps
    ``build_items``' work across the splits tried (the beam search shares it)."""

    def __init__(self, place: Place, request: PlanRequest) -> None:
        self.place, self.request = place, request
        self.cache: dict[Any, Any] = {}

    def __call__(self, splits: Splits) -> Placed:
        r = self.request
        items, widths = build_items(r.stats, r.model, r.constraints, splits, self.cache)
        loads = Loads(r.model, len(widths))
        self.place(r, items, loads)
        return items, loads


Improve = Callable[[PlanRequest, Placing, Splits, Placed], Placed]


@dataclass(frozen=True)
class Planner:
    """One entry of ``PLANNERS``. ``place`` puts the shards of one split on the devices
    (the splits grow until the tables pack); ``improve`` (optional) searches from the
    split that packs for a better placement; ``prepare`` (optional) loads what the
    planner needs (its weights) before any placing."""

    name: str
    place: Place
    improve: Improve | None = None
    prepare: Callable[[PlanRequest], PlanRequest] | None = None

    def plan(self, request: PlanRequest) -> PlanResult:
        start, cpu_start = time.perf_counter(), time.process_time()
        if self.prepare is not None:
            request = self.prepare(request)
        placing = Placing(self.place, request)
        splits, placed = split_until_packed(
            request.stats, request.model, request.constraints, placing
        )
        if self.improve is not None:
            placed = self.improve(request, placing, splits, placed)
        items, loads = placed
        result = _result(items, loads, request.model, self.name, time.perf_counter() - start)
        result.cpu_seconds = time.process_time() - cpu_start
        result.plan.validate(
            [TableConfig(s.name, s.num_embeddings, s.embedding_dim) for s in request.stats]
        )
        return result


PLANNERS: dict[str, Planner] = {}


def register(planner: Planner) -> Planner:
    """Add ``planner`` to ``PLANNERS`` (once: a name taken is refused)."""
    if planner.name in PLANNERS:
        raise ValueError(f"a planner named {planner.name!r} is registered already")
    PLANNERS[planner.name] = planner
    return planner


def plan_tables(
    stats: Sequence[TableStats],
    model: CostModel,
    planner: str = "search",
    constraints: Mapping[str, TableConstraint] | None = None,
    **settings: Any,
) -> PlanResult:
    """``get_planner(planner).plan(PlanRequest(...))`` in one call: ``settings`` are the
    other ``PlanRequest`` fields (``seed``, ``weights``, ``policy``, ...)."""
    entry = get_planner(planner)
    return entry.plan(PlanRequest(stats, model, constraints or {}, **settings))


def get_planner(planner: str) -> Planner:
    """The entry of ``PLANNERS`` named ``planner``; an unknown name lists the others."""
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}")
    return PLANNERS[planner]


# ------------------------------------------------------------------ the planners
def _greedy(key: str, request: PlanRequest, items: list[Item], loads: Loads) -> None:
    greedy(items, loads, key, request.seed)


def _lpt(request: PlanRequest, items: list[Item], loads: Loads) -> None:
    lpt(items, loads)


def _lpt_refined(request: PlanRequest, items: list[Item], loads: Loads) -> None:
    lpt(items, loads)
    refine(items, loads, request.refine_rounds)


def _learned(name: str, request: PlanRequest, items: list[Item], loads: Loads) -> None:
    place_learned(items, loads, name, request.weights)


def _beam(request: PlanRequest, placing: Placing, splits: Splits, placed: Placed) -> Placed:
    """``search``: the splits of the beam search, placed by LPT + refine, if better."""
    found = beam_search(
        request.stats, request.model, request.constraints, splits, request.beam, placing.cache
    )
    if found != splits:
        other = placing(found)
        if other[1].totals().max() < placed[1].totals().max():
            return other
    return placed


def _neuroshard_policy(request: PlanRequest) -> PlanRequest:
    """The cost models (``weights``, or the shipped ones) unless given; a warning when
    they were trained on another embedding kernel than ``kernel``."""
    policy = request.policy or load_policy(request.weights)
    trained = policy.info.get("kernel")
    if request.kernel != "auto" and trained and request.kernel != trained:
        log.warning(
            "plan.weights were trained on the %r embedding kernel's costs but "
            "embedding.backend is %r: collect costs with --backend %s and retrain "
            "(towerrec plan collect-costs, towerrec plan train-policy) for a matching model",
            trained,
            request.kernel,
            request.kernel,
        )
    return replace(request, policy=policy)


def _neuroshard(request: PlanRequest, placing: Placing, splits: Splits, placed: Placed) -> Placed:
    """``neuroshard``: its own search from the splits that pack (LPT found them)."""
    assert request.policy is not None  # _neuroshard_policy loaded it
    beam = request.beam
    found = search_neuroshard(
        request.stats,
        request.model,
        request.policy,
        request.constraints,
        splits,
        beam.width,
        beam.depth,
        beam.branch,
    )
    if found is None:
        log.warning("neuroshard: no greedy grid point packs the tables; using LPT's placement")
        return placed
    loads = Loads(request.model, found.num_widths)
    for i, rank in enumerate(found.ranks):
        loads.add(rank, i, found.items[i])
    return found.items, loads


for _key in GREEDY_KEYS:
    register(Planner(_key, partial(_greedy, _key)))
register(Planner("lpt", _lpt_refined))
register(Planner("search", _lpt_refined, improve=_beam))
register(Planner("neuroshard", _lpt, improve=_neuroshard, prepare=_neuroshard_policy))
for _name in LEARNED_PLANNERS:
    register(Planner(_name, partial(_learned, _name)))


# ------------------------------------------------------------------ output
def _result(
    items: Sequence[Item], loads: Loads, model: CostModel, planner: str, seconds: float
) -> PlanResult:
    topo = model.topology
    tables: dict[str, list[Shard]] = {}
    kinds: dict[str, ShardingType] = {}
    for rank, members in enumerate(loads.on):
        for i in members:
            it = items[i]
            tables.setdefault(it.table, []).append(Shard(rank, it.rows, it.cols))
            kinds[it.table] = it.sharding
    order = list(dict.fromkeys(it.table for it in items))
    plan = ShardingPlan(
        topo.world_size,
        topo.hosts,
        {
            name: TablePlan(
                name, kinds[name], tuple(sorted(tables[name], key=lambda s: (s.rows, s.cols)))
            )
            for name in order
        },
    )
    labels = []
    for members in loads.on:
        names = []
        for i in sorted(members):
            it = items[i]
            whole = it.sharding is ShardingType.TABLE_WISE
            names.append(it.table if whole else f"{it.table}[{it.sharding.value}]")
        labels.append(names)
    return PlanResult(
        plan,
        planner,
        [float(x) for x in loads.totals()],
        [float(x) for x in loads.memory],
        labels,
        seconds,
    )


def evaluate_plan(
    plan: ShardingPlan, stats: Sequence[TableStats], model: CostModel, name: str = "given"
) -> PlanResult:
    """What ``model`` predicts for an existing ``plan`` (from a file, another planner)."""
    by_name = {s.name: s for s in stats}
    plan.validate([TableConfig(s.name, s.num_embeddings, s.embedding_dim) for s in stats])
    if plan.world_size != model.topology.world_size:
        raise ValueError(
            f"plan is for {plan.world_size} ranks, the topology has {model.topology.world_size}"
        )
    raw = [
        (by_name[n], g, tp.sharding, s)
        for g, (n, tp) in enumerate(plan.tables.items())
        for s in tp.shards
    ]
    widths = sorted({s.num_cols for *_, s in raw})
    index = {w: i for i, w in enumerate(widths)}
    items = [
        Item(
            st.name,
            kind,
            s.rows,
            s.cols,
            model.shard_cost(st, kind, s.num_rows, s.num_cols).total,
            model.shard_memory(st, s.num_rows, s.num_cols),
            index[s.num_cols],
            g,
            s.rank,
            st,
        )
        for st, g, kind, s in raw
    ]
    loads = Loads(model, len(widths))
    for i, it in enumerate(items):
        assert it.fixed_rank is not None  # every shard of a plan has its rank
        loads.add(it.fixed_rank, i, it)
    result = _result(items, loads, model, name, 0.0)
    result.plan = plan
    return result
