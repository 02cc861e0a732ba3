"""The learned planners by name: their shipped weights, loading, and training.

The ``dreamshard`` and ``autoshard`` entries of ``search.PLANNERS`` place with
``learned_placer(planner)``: the weights in ``planner/weights/<planner>.pt`` unless a
file is given. ``train_policy`` trains one from a cost-data file and writes its
weights; the shipped ones come from::

    python -c "from towerrec.planner.learned_planners import train_policy as t; \\
        [t(p, 'docs/results/kernel-samples.json', 'src/towerrec/planner/weights', seed=0) \\
         for p in ('dreamshard', 'autoshard')]"

(``docs/results/kernel-samples.json``: 200 devices measured by ``towerrec bench
costmodel --save-samples``; a ``towerrec plan collect-costs`` file, with forward,
backward and all-to-alls apart, trains the same way).

Training tasks are drawn from the training half of ``dlrm_like_suite(856)`` (the
split ``split_suite`` makes, the one ``towerrec bench plan --learned`` evaluates
on), rows capped at ``TRAIN_MAX_ROWS`` like the measured devices, 10..60 tables
on 2, 4 or 8 devices.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from towerrec.planner import autoshard, dreamshard
from towerrec.planner.costdata import CostData
from towerrec.planner.learned_policy import (
    CostSamples,
    PolicyPlacer,
    PolicyWeights,
    Shards,
    Task,
    training_tasks,
)
from towerrec.planner.stats import TableStats
from towerrec.planner.suites import dlrm_like_suite

__all__ = [
    "LEARNED",
    "LEARNED_PLANNERS",
    "TRAIN_MAX_ROWS",
    "LearnedPlanner",
    "default_weights_path",
    "learned_placer",
    "load_cost_data",
    "one_thread",
    "split_suite",
    "train_policy",
]


@dataclass(frozen=True)
class LearnedPlanner:
    """A learned placement policy: its ``placer`` of a weights file, and how it is
    trained (``train(data, tasks, seed, options)``)."""

    placer: Callable[[PolicyWeights], PolicyPlacer[Any, Any]]
    train: Callable[[CostSamples, list[Task], int, dict[str, Any]], PolicyWeights]


def _train_dreamshard(
    data: CostSamples, tasks: list[Task], seed: int, options: dict[str, Any]
) -> PolicyWeights:
    return dreamshard.train_dreamshard(
        data.devices,
        data.seconds,
        tasks,
        split=data.split,
        comm=data.comm,
        batch=data.batch,
        seed=seed,
        **options,
    )


def _train_autoshard(
    data: CostSamples, tasks: list[Task], seed: int, options: dict[str, Any]
) -> PolicyWeights:
    return autoshard.train_autoshard(
        data.devices, data.seconds, tasks, batch=data.batch, seed=seed, **options
    )


LEARNED = {
    "dreamshard": LearnedPlanner(dreamshard.DreamShardPlacer, _train_dreamshard),
    "autoshard": LearnedPlanner(autoshard.AutoShardPlacer, _train_autoshard),
}
LEARNED_PLANNERS = tuple(LEARNED)
WEIGHTS_DIR = Path(__file__).parent / "weights"
TRAIN_MAX_ROWS = 200_000


def _check(planner: str) -> None:
    if planner not in LEARNED_PLANNERS:
        raise ValueError(
            f"unknown learned planner {planner!r}; choose one of {', '.join(LEARNED_PLANNERS)}"
        )


def default_weights_path(planner: str) -> Path:
    _check(planner)
    return WEIGHTS_DIR / f"{planner}.pt"


@lru_cache(maxsize=16)
def _placer(planner: str, path: str, mtime: float) -> PolicyPlacer[Any, Any]:
    return LEARNED[planner].placer(PolicyWeights.load(path, planner))


def learned_placer(planner: str, weights: str | Path | None = None) -> PolicyPlacer[Any, Any]:
    """The placer of ``planner`` with ``weights`` (a file; None: the shipped one)."""
    _check(planner)
    path = Path(weights) if weights else default_weights_path(planner)
    if not path.is_file():
        raise FileNotFoundError(
            f"{planner} weights file {str(path)!r} does not exist; train one with "
            f"`towerrec plan train-policy --planner {planner} --cost-data COSTS --out DIR`"
        )
    return _placer(planner, str(path.resolve()), path.stat().st_mtime)


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread while a policy places shards: its networks are tiny, and extra
    threads only spin (on a busy CPU, a matmul of a few hundred values then takes a
    millisecond instead of microseconds). The caller's setting comes back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def split_suite(
    suite: list[TableStats], seed: int = 0
) -> tuple[list[TableStats], list[TableStats]]:
    """Disjoint halves (train, test) of ``suite``, by a seeded permutation."""
    order = np.random.default_rng([seed, 29]).permutation(len(suite))
    half = len(suite) // 2
    return [suite[i] for i in sorted(order[:half])], [suite[i] for i in sorted(order[half:])]


def load_cost_data(path: str | Path) -> CostSamples:
    """Measured costs from a ``towerrec plan collect-costs`` file (planner/costdata.py:
    forward and backward apart, all-to-alls), or from the list of ``{"shards": [...],
    "seconds": t}`` that ``towerrec bench costmodel --save-samples`` writes (batch 2048)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"cost data {str(path)!r} does not exist; measure some with "
            f"`towerrec plan collect-costs --out {path}`"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"cost data {str(path)!r} is not valid JSON: {e}") from None
    if isinstance(data, dict):
        costs = CostData.from_json(data, f"cost data file {str(path)!r}", path=str(path))
        return CostSamples(
            [list(c.shards) for c in costs.compute],
            [c.seconds for c in costs.compute],
            [(c.forward_s, c.backward_s) for c in costs.compute],
            [(c.dims, c.seconds) for c in costs.comm],
            costs.batch,
        )
    devices: list[Shards] = []
    seconds: list[float] = []
    for n, entry in enumerate(data if isinstance(data, list) else []):
        try:
            shards = []
            for sh in entry["shards"]:
                sh = dict(sh)
                rows, cols = int(sh.pop("rows")), int(sh.pop("cols"))
                sh["feature_names"] = tuple(sh.get("feature_names", ()))
                shards.append((TableStats(**sh), rows, cols))
            devices.append(shards)
            seconds.append(float(entry["seconds"]))
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"cost data {str(path)!r}, device {n}: {type(e).__name__} {e}; expected "
                '{"shards": [{...TableStats fields, "rows": R, "cols": C}], "seconds": t}'
            ) from None
    if not devices:
        raise ValueError(f"cost data {str(path)!r} holds no measured devices")
    return CostSamples(devices, seconds)


def default_training_tasks(seed: int = 0, num_tasks: int = 200) -> list[Task]:
    """Training tasks from the training half of the DLRM-like suite (rows capped)."""
    train, _ = split_suite(dlrm_like_suite(856, seed=0), seed)
    capped = [replace(s, num_embeddings=min(s.num_embeddings, TRAIN_MAX_ROWS)) for s in train]
    return training_tasks(capped, num_tasks, 10, 60, (2, 4, 8), seed)


def train_policy(
    planner: str, cost_data_path: str | Path, out_dir: str | Path, seed: int = 0, **options: Any
) -> Path:
    """Train ``planner`` on the cost data file and the default training tasks; writes and
    returns ``out_dir/<planner>.pt``. Deterministic given ``seed``."""
    _check(planner)
    data = load_cost_data(cost_data_path)
    weights = LEARNED[planner].train(data, default_training_tasks(seed), seed, options)
    path = Path(out_dir) / f"{planner}.pt"
    weights.save(path)
    return path
