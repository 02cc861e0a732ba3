"""``towerrec bench plan``: every planner on the same synthetic tasks, as JSON.

Three parts, all on tables drawn by ``planner.suites.dlrm_like_suite`` (856
tables shaped like Meta's DLRM sharding data set):

    tasks      ``--tasks`` random tasks of 10..60 tables on 4 devices (64 GiB each, so
               memory never binds and the planners compete on balance): each planner's
               max-device cost under the cost model, its ratio to the best greedy
               baseline of the same task, planning time; TorchRec's planner on the
               first ``--torchrec-tasks`` of them (its plan scored by the same model)
    full       all 856 tables on 128 devices (16 hosts x 8): max cost, imbalance, time
    measured   ``--measured-tasks`` small tasks (rows capped to fit this machine) planned
               with this machine's constants; each device's shards then run through the
               real EmbeddingBagCollection (forward + backward + fused update) and the
               slowest device's kernel time is reported per planner

``neuroshard`` plans with the shipped weights (or ``--neuroshard-weights``); like
every planner, its plans are scored by the cost model below (and, in ``measured``,
timed).

``--learned`` runs instead the learned planners' protocol (bench/plan_learned.py:
DreamShard's train / unseen test split, transfer to more tables and devices).

The cost model: ``--calibration FILE`` (from ``towerrec plan --calibrate``) on
the ``cpu`` topology, or the default constants on ``--topology``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from towerrec.bench.common import Benchmark, machine_info
from towerrec.bench.plan_learned import learned_part
from towerrec.calibration import device_step
from towerrec.planner.cost import CostConstants, CostModel
from towerrec.planner.neuroshard import load_policy
from towerrec.planner.search import GREEDY_KEYS, PLANNERS, PlanRequest, evaluate_plan
from towerrec.planner.stats import TableStats
from towerrec.planner.suites import dlrm_like_suite, planning_tasks
from towerrec.planner.topology import topology_preset
from towerrec.sharding import ShardingType

__all__ = ["BENCHMARK", "run_plan_benchmark", "torchrec_planner_plan"]


def torchrec_planner_plan(stats: list[TableStats], model: CostModel):
    """TorchRec's EmbeddingShardingPlanner on the same tables and topology, as our plan."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner import Topology as TorchrecTopology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from towerrec.interop.torchrec_plan import from_torchrec_plan

    topo = model.topology
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=s.name,
                embedding_dim=s.embedding_dim,
                num_embeddings=s.num_embeddings,
                feature_names=[s.name],
            )
            for s in stats
        ],
        device=torch.device("meta"),
    )
    types = [
        ShardingType.TABLE_WISE,
        ShardingType.COLUMN_WISE,
        ShardingType.ROW_WISE,
        ShardingType.TABLE_ROW_WISE,
    ]
    planner = EmbeddingShardingPlanner(
        topology=TorchrecTopology(
            world_size=topo.world_size,
            local_world_size=topo.ranks_per_host,
            compute_device="cuda",
            hbm_cap=int(topo.device_memory),
        ),
        batch_size=model.batch_size,
        constraints={
            s.name: ParameterConstraints(sharding_types=types, pooling_factors=[s.pooling_factor])
            for s in stats
        },
        debug=False,
    )
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return from_torchrec_plan(plan, "", topo.world_size, topo.hosts)


TASK_DEVICE_MEMORY = 64 * (1 << 30)  # memory never binds in the 4-device tasks: balance does


def _model(topology, calibration, hosts, local, batch, **overrides):
    if calibration:
        topo = topology_preset("cpu", hosts, local, **overrides)
        return CostModel(topo, CostConstants.load(calibration), batch)
    return CostModel(topology_preset(topology, hosts, local, **overrides), None, batch)


def _tasks_part(suite, model, num_tasks, torchrec_tasks, seed, policy) -> dict:
    tasks = planning_tasks(suite, num_tasks, 10, 60, seed=seed)
    cost: dict[str, list[float]] = {p: [] for p in PLANNERS}
    seconds: dict[str, list[float]] = {p: [] for p in PLANNERS}
    cpu_seconds: dict[str, list[float]] = {p: [] for p in PLANNERS}
    for task in tasks:
        request = PlanRequest(task, model, seed=seed, policy=policy)
        for p, planner in PLANNERS.items():
            r = planner.plan(request)
            cost[p].append(r.max_cost)
            seconds[p].append(r.seconds)
            cpu_seconds[p].append(r.cpu_seconds)
    best_greedy = np.min([cost[p] for p in GREEDY_KEYS], axis=0)
    out = {
        "num_tasks": num_tasks,
        "tables_per_task": [10, 60],
        "devices": model.topology.world_size,
        "planners": {
            p: {
                "mean_max_cost_ms": float(np.mean(cost[p]) * 1e3),
                "mean_ratio_to_best_greedy": float(np.mean(np.array(cost[p]) / best_greedy)),
                "mean_planning_s": float(np.mean(seconds[p])),
                "mean_planning_cpu_s": float(np.mean(cpu_seconds[p])),
            }
            for p in PLANNERS
        },
    }
    if torchrec_tasks:
        try:
            import torchrec  # noqa: F401
        except ImportError:
            out["torchrec"] = {"skipped": "torchrec is not installed"}
            return out
        ratios, planning = [], []
        for k, task in enumerate(tasks[:torchrec_tasks]):
            start = time.perf_counter()
            plan = torchrec_planner_plan(task, model)
            planning.append(time.perf_counter() - start)
            ratios.append(evaluate_plan(plan, task, model).max_cost / best_greedy[k])
        search = np.array(cost["search"][:torchrec_tasks]) / best_greedy[:torchrec_tasks]
        out["torchrec"] = {
            "num_tasks": torchrec_tasks,
            "mean_ratio_to_best_greedy": float(np.mean(ratios)),
            "search_mean_ratio_to_best_greedy_same_tasks": float(np.mean(search)),
            "mean_planning_s": float(np.mean(planning)),
        }
    return out


def _full_part(suite, model, seed, policy) -> dict:
    topo = model.topology
    out = {"num_tables": len(suite), "devices": topo.world_size, "hosts": topo.hosts}
    out["planners"] = {}
    for p, planner in PLANNERS.items():
        r = planner.plan(PlanRequest(suite, model, seed=seed, policy=policy))
        out["planners"][p] = {
            "max_cost_ms": r.max_cost * 1e3,
            "imbalance": r.imbalance,
            "planning_s": r.seconds,
            "planning_cpu_s": r.cpu_seconds,
        }
    return out


def _measured_part(suite, calibration, num_tasks, seed, policy, max_rows=50_000, rounds=5) -> dict:
    """Each task's distinct device loads (identical plans share them) timed round-robin:
    ``rounds`` rounds, each running every device once (time_interleaved), so drift in
    this shared machine's speed hits every planner alike."""
    import torch

    from towerrec.bench.common import time_interleaved

    batch = 512
    model = _model("cpu", calibration, 1, 4, batch)
    small = [
        replace(s, num_embeddings=min(s.num_embeddings, max_rows), distinct_per_batch=0.0)
        for s in suite
    ]
    tasks = planning_tasks(small, num_tasks, 8, 16, seed=seed + 1)
    measured: dict[str, list[float]] = {p: [] for p in PLANNERS}
    predicted: dict[str, list[float]] = {p: [] for p in PLANNERS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t, task in enumerate(tasks):
            by_name = {s.name: s for s in task}
            loads: dict[tuple, list] = {}  # a device's shards -> (shards, planners x ranks)
            for p, planner in PLANNERS.items():
                r = planner.plan(PlanRequest(task, model, seed=seed, policy=policy))
                predicted[p].append(r.max_cost)
                for rank in range(model.topology.world_size):
                    shards = [(name, sh.rows, sh.cols) for name, sh in r.plan.shards_on(rank)]
                    key = tuple(sorted(shards))
                    loads.setdefault(key, [shards, []])[1].append(p)
            steps = {
                str(i): device_step(
                    [(by_name[n], rows[1] - rows[0], cols[1] - cols[0]) for n, rows, cols in sh],
                    batch * 4,  # every device serves the lookups of the global batch
                    seed=t,
                )
                for i, (sh, _) in enumerate(loads.values())
                if sh
            }
            seconds = time_interleaved(steps, rounds=rounds, steps_per_round=1, warmup=2)
            worst = dict.fromkeys(PLANNERS, 0.0)
            for i, (_, owners) in enumerate(loads.values()):
                for p in owners:
                    worst[p] = max(worst[p], seconds.get(str(i), 0.0))
            for p in PLANNERS:
                measured[p].append(worst[p])
    finally:
        torch.set_num_threads(threads)
    best_greedy = np.min([measured[p] for p in GREEDY_KEYS], axis=0)
    best_baseline = min(GREEDY_KEYS, key=lambda p: np.mean(measured[p]))
    return {
        "num_tasks": num_tasks,
        "tables_per_task": [8, 16],
        "max_rows": max_rows,
        "devices": 4,
        "rounds": rounds,
        "what": "slowest device's measured forward+backward+update kernel time (no comms)",
        "best_baseline_on_average": best_baseline,
        "planners": {
            p: {
                "mean_measured_max_ms": float(np.mean(measured[p]) * 1e3),
                "ratio_to_best_baseline_mean": float(
                    np.mean(measured[p]) / np.mean(measured[best_baseline])
                ),
                "mean_measured_ratio_to_best_greedy_per_task": float(
                    np.mean(np.array(measured[p]) / best_greedy)
                ),
                "mean_predicted_max_ms": float(np.mean(predicted[p]) * 1e3),
            }
            for p in PLANNERS
        },
    }


def run_plan_benchmark(
    tasks: int = 100,
    torchrec_tasks: int = 20,
    measured_tasks: int = 5,
    full: bool = True,
    topology: str = "gpu",
    calibration: str | None = None,
    batch_size: int = 512,
    seed: int = 0,
    neuroshard_weights: str | None = None,
) -> dict:
    suite = dlrm_like_suite(856, seed=seed, batch_size=batch_size)
    policy = load_policy(neuroshard_weights)
    small_model = _model(topology, calibration, 1, 4, batch_size, device_memory=TASK_DEVICE_MEMORY)
    result: dict[str, Any] = {
        "benchmark": "plan",
        "machine": machine_info(),
        "cost_model": {
            "topology": "cpu" if calibration else topology,
            "constants": small_model.constants.source,
            "batch_size_per_rank": batch_size,
            "task_device_memory_gib": TASK_DEVICE_MEMORY / (1 << 30),
        },
        "neuroshard_policy": {
            "weights": neuroshard_weights or "shipped",
            "cost_data_sha256": policy.info.get("cost_data", {}).get("sha256"),
            "cost_data_cpu": policy.info.get("cost_data", {}).get("machine", {}).get("cpu"),
            "kernel": policy.info.get("kernel"),
            "compute_held_out_median_rel_error": policy.info.get(
                "compute_held_out_median_rel_error"
            ),
        },
        "tasks": _tasks_part(suite, small_model, tasks, torchrec_tasks, seed, policy),
    }
    if full:
        result["full"] = _full_part(
            suite, _model(topology, calibration, 16, 8, batch_size), seed, policy
        )
    if measured_tasks:
        result["measured"] = _measured_part(suite, calibration, measured_tasks, seed, policy)
    planners = result["tasks"]["planners"]
    result["targets"] = {
        "search_mean_ratio_to_best_greedy": planners["search"]["mean_ratio_to_best_greedy"],
        "target_ratio": 0.9,
    }
    if full:
        search = result["full"]["planners"]["search"]
        result["targets"]["plan_856_on_128_s"] = search["planning_s"]
        result["targets"]["plan_856_on_128_cpu_s"] = search["planning_cpu_s"]
        result["targets"]["target_s"] = 5.0
        neuro = result["full"]["planners"]["neuroshard"]
        result["targets"]["neuroshard_plan_856_on_128_s"] = neuro["planning_s"]
        result["targets"]["neuroshard_plan_856_on_128_cpu_s"] = neuro["planning_cpu_s"]
    return result


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=int, default=100, help="tasks of 10-60 tables on 4 devices")
    parser.add_argument(
        "--torchrec-tasks", type=int, default=20, help="of those, for TorchRec's planner"
    )
    parser.add_argument("--measured-tasks", type=int, default=5, help="tasks timed on this machine")
    parser.add_argument("--no-full", action="store_true", help="skip 856 tables on 128 devices")
    parser.add_argument("--no-torchrec", action="store_true", help="skip TorchRec's planner")
    parser.add_argument("--topology", default="gpu", help="topology preset without --calibration")
    parser.add_argument("--calibration", help="constants from `towerrec plan --calibrate` (cpu)")
    parser.add_argument(
        "--learned",
        action="store_true",
        help="only the learned planners' protocol: train on half the tables, test on the rest",
    )
    parser.add_argument(
        "--learned-scale",
        type=float,
        default=1.0,
        help="with --learned: policy training batches x this (1.0: 4 x 75 DreamShard, 300 AutoShard)",
    )
    parser.add_argument(
        "--neuroshard-weights",
        help="neuroshard weights (towerrec plan train-policy); default: shipped",
    )


def _run(args: argparse.Namespace) -> dict:
    if args.learned:
        loadavg = Path("/proc/loadavg")
        load = loadavg.read_text().split()[:3] if loadavg.exists() else []
        result = learned_part(args.calibration, train_scale=args.learned_scale)
        end = loadavg.read_text().split()[:3] if loadavg.exists() else []
        return {
            "benchmark": "plan --learned",
            "machine": machine_info(),
            "loadavg_start": load,
            "loadavg_end": end,
            **result,
        }
    return run_plan_benchmark(
        tasks=args.tasks,
        torchrec_tasks=0 if args.no_torchrec else args.torchrec_tasks,
        measured_tasks=args.measured_tasks,
        full=not args.no_full,
        topology=args.topology,
        calibration=args.calibration,
        neuroshard_weights=args.neuroshard_weights,
    )


BENCHMARK = Benchmark("planners on synthetic DLRM-like table suites", _add_arguments, _run)
