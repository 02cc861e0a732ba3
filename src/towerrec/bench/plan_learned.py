"""``towerrec bench plan --learned``: the learned planners under DreamShard's protocol.

::

    dlrm_like_suite(856), rows capped at ``MAX_ROWS`` (so every device runs here)
        │  split_suite: disjoint halves, train tables | test tables
        ▼
    cost data      ``cost_devices`` random groups of 1..24 training tables, measured
                   (forward + backward + fused update, one thread, global batch ``BATCH``)
    training       DreamShard (with the paper's collection: each iteration measures the
                   devices of a few of its own plans) and AutoShard, on training tasks of
                   10..60 training tables on 2, 4 and 8 devices
    test           unseen tasks of 10..60 test tables on 2, 4, 8 devices: every planner's
                   max device cost under the calibrated cost model, as a ratio to the best
                   greedy baseline; the first ``measured`` of them executed here too
    transfer       no fine-tuning: 100..200 test tables on 16 and 128 devices (cost model;
                   one 16-device task measured)
    time           856 tables on 128 devices, every planner

Measured cost: each task's distinct device loads timed round-robin (``time_interleaved``,
as the measured part of ``towerrec bench plan``), the slowest device per planner; no
communication (one process).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from towerrec.bench.common import time_interleaved
from towerrec.calibration import device_step, measure_device
from towerrec.planner.autoshard import train_autoshard
from towerrec.planner.cost import CostConstants, CostModel
from towerrec.planner.dreamshard import train_dreamshard
from towerrec.planner.learned_planners import LEARNED_PLANNERS, split_suite
from towerrec.planner.learned_policy import training_tasks
from towerrec.planner.search import GREEDY_KEYS, PLANNERS, PlanRequest, PlanResult
from towerrec.planner.stats import TableStats
from towerrec.planner.suites import dlrm_like_suite
from towerrec.planner.topology import topology_preset

__all__ = ["learned_part"]

MAX_ROWS = 50_000
BATCH = 2048  # global samples per step: every device serves their lookups


def _model(calibration: str | None, devices: int) -> CostModel:
    topo = topology_preset("cpu", 1, devices)
    constants = CostConstants.load(calibration) if calibration else None
    return CostModel(topo, constants, max(1, BATCH // devices))


def _cost_data(train: list[TableStats], num: int, seed: int) -> tuple[list, list]:
    rng = np.random.default_rng([seed, 61])
    devices, seconds = [], []
    for d in range(num):
        size = int(rng.integers(1, 25))
        chosen = rng.choice(len(train), size, replace=False)
        shards = [(train[i], train[i].num_embeddings, train[i].embedding_dim) for i in chosen]
        devices.append(shards)
        seconds.append(measure_device(shards, BATCH, reps=3, seed=d))
    return devices, seconds


def _plan_all(tables: list[TableStats], model: CostModel, weights: dict[str, str], seed: int):
    out: dict[str, PlanResult] = {}
    for p, planner in PLANNERS.items():
        out[p] = planner.plan(PlanRequest(tables, model, seed=seed, weights=weights.get(p)))
    return out


def _measure(tables: list[TableStats], plans: dict[str, PlanResult], seed: int) -> dict:
    """Slowest device's measured seconds per planner (identical devices timed once)."""
    by_name = {s.name: s for s in tables}
    loads: dict[tuple, list] = {}
    for p, r in plans.items():
        for rank in range(r.plan.world_size):
            shards = [(name, sh.rows, sh.cols) for name, sh in r.plan.shards_on(rank)]
            loads.setdefault(tuple(sorted(shards)), [shards, []])[1].append(p)
    steps = {
        str(i): device_step(
            [(by_name[n], rows[1] - rows[0], cols[1] - cols[0]) for n, rows, cols in sh],
            BATCH,
            seed=seed,
        )
        for i, (sh, _) in enumerate(loads.values())
        if sh
    }
    seconds = time_interleaved(steps, rounds=3, steps_per_round=1, warmup=1)
    worst = dict.fromkeys(plans, 0.0)
    for i, (_, owners) in enumerate(loads.values()):
        for p in owners:
            worst[p] = max(worst[p], seconds.get(str(i), 0.0))
    return worst


def _ratios(values: dict[str, list[float]]) -> dict[str, float]:
    best = np.min([values[p] for p in GREEDY_KEYS], axis=0)
    return {p: float(np.mean(np.array(v) / best)) for p, v in values.items()}


def _evaluate(tasks, calibration, weights, seed, measured: int) -> dict:
    cost: dict[str, list[float]] = {p: [] for p in PLANNERS}
    timing: dict[str, list[float]] = {p: [] for p in PLANNERS}
    measured_s: dict[str, list[float]] = {p: [] for p in PLANNERS}
    by_devices: dict[int, dict[str, list[float]]] = {}
    for k, (tables, devices) in enumerate(tasks):
        plans = _plan_all(tables, _model(calibration, devices), weights, seed)
        best = min(plans[p].max_cost for p in GREEDY_KEYS)
        group = by_devices.setdefault(devices, {p: [] for p in PLANNERS})
        for p, r in plans.items():
            cost[p].append(r.max_cost)
            timing[p].append(r.seconds)
            group[p].append(r.max_cost / best)
        if k < measured:
            for p, t in _measure(tables, plans, seed + k).items():
                measured_s[p].append(t)
    out: dict[str, Any] = {
        "num_tasks": len(tasks),
        "cost_model_ratio_to_best_greedy": _ratios(cost),
        "cost_model_ratio_by_devices": {
            str(d): {p: float(np.mean(v)) for p, v in g.items()}
            for d, g in sorted(by_devices.items())
        },
        "mean_planning_s": {p: float(np.mean(v)) for p, v in timing.items()},
    }
    if measured:
        out["measured_tasks"] = min(measured, len(tasks))
        out["measured_ratio_to_best_greedy"] = _ratios(measured_s)
        out["measured_mean_max_ms"] = {p: float(np.mean(v) * 1e3) for p, v in measured_s.items()}
    return out


def learned_part(
    calibration: str | None,
    seed: int = 0,
    cost_devices: int = 120,
    train_tasks: int = 100,
    test_tasks: int = 30,
    measured: int = 12,
    transfer_tasks: int = 4,
    train_scale: float = 1.0,
    transfer_measured: int = 1,
) -> dict:
    """The learned planners' protocol (module doc): ``measured`` of the unseen tasks and
    ``transfer_measured`` of the 16-device transfer tasks also timed on real kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _learned_part(
            calibration, seed, cost_devices, train_tasks, test_tasks, measured, transfer_tasks,
            train_scale, transfer_measured,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _learned_part(
    calibration, seed, cost_devices, train_tasks, test_tasks, measured, transfer_tasks, scale,
    transfer_measured,
) -> dict:  # fmt: skip
    suite = dlrm_like_suite(856, seed=0, batch_size=BATCH)
    capped = [
        replace(s, num_embeddings=min(s.num_embeddings, MAX_ROWS), distinct_per_batch=0.0)
        for s in suite
    ]
    train, test = split_suite(capped, seed)
    start = time.perf_counter()
    devices, seconds = _cost_data(train, cost_devices, seed)
    collect_s = time.perf_counter() - start
    tasks = training_tasks(train, train_tasks, 10, 60, (2, 4, 8), seed)

    def measure(shards) -> float:
        return measure_device(shards, BATCH, reps=3, seed=len(shards))

    start = time.perf_counter()
    dream = train_dreamshard(
        devices, seconds, tasks, seed=seed, measure=measure, batch=BATCH,
        policy_batches=max(1, int(75 * scale)),
    )  # fmt: skip
    dream_s = time.perf_counter() - start
    start = time.perf_counter()
    auto = train_autoshard(
        devices, seconds, tasks, seed=seed, batch=BATCH, policy_batches=max(1, int(300 * scale))
    )
    auto_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        weights = {}
        for name, w in (("dreamshard", dream), ("autoshard", auto)):
            weights[name] = str(Path(tmp) / f"{name}.pt")
            w.save(weights[name])
        test_set = training_tasks(test, test_tasks, 10, 60, (2, 4, 8), seed + 1)
        # measured: the first tasks of each device count
        test_set.sort(key=lambda t: t[1])
        order = [i for group in zip(*[[i for i, t in enumerate(test_set) if t[1] == d]
                 for d in (2, 4, 8)]) for i in group]  # fmt: skip
        rest = [i for i in range(len(test_set)) if i not in order]
        test_set = [test_set[i] for i in order + rest]
        unseen = _evaluate(test_set, calibration, weights, seed, measured)
        transfer = {}
        for devs in (16, 128):
            t = training_tasks(test, transfer_tasks, 100, 200, (devs,), seed + devs)
            transfer[str(devs)] = _evaluate(
                t, calibration, weights, seed, transfer_measured if devs == 16 else 0
            )
        full_model = _model(calibration, 128)
        timing = {
            p: planner.plan(
                PlanRequest(capped, full_model, seed=seed, weights=weights.get(p))
            ).seconds
            for p, planner in PLANNERS.items()
        }
    return {
        "protocol": {
            "max_rows": MAX_ROWS,
            "global_batch": BATCH,
            "train_tables": len(train),
            "test_tables": len(test),
            "cost_data_devices": cost_devices,
            "cost_data_after_collection": dream.extra["cost_data_devices"],
            "train_tasks": train_tasks,
            "train_devices": [2, 4, 8],
            "cost_model": "cpu topology, " + (calibration or "default constants"),
            "measured": "slowest device's forward+backward+update kernel time (no comms)",
        },
        "seconds": {"collect": collect_s, "train_dreamshard": dream_s, "train_autoshard": auto_s},
        "learned_planners": list(LEARNED_PLANNERS),
        "unseen_test_tasks": unseen,
        "transfer": transfer,
        "plan_856_on_128_s": timing,
    }
