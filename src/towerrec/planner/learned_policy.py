"""What the learned placement policies (DreamShard, AutoShard) share: shard features,
training tasks, the weights file and its checks, the networks' building blocks, and
the placement interface with its session.

A policy places the shards of a task one at a time (``order``, then ``choose`` for
each with the devices that have room), the same loop the greedy planners run
(planner/algorithms.py), so memory and pinned tables are handled once for all. A
``PolicySession`` keeps, per device, the sums of the placed shards' encodings (by the
cost network and by the policy's shard encoder) that both policies score devices by;
``PolicyPlacer`` builds the networks of a weights file once and a session per task.

Weights file (``torch.save`` of a plain dict, loaded with ``weights_only``)::

    format            "towerrec-learned-sharding"
    version           1
    planner           "dreamshard" | "autoshard"
    feature_layout    the names of the shard features below, in order
    trained_devices   the device counts of the training tasks
    cost_data_sha256  hash of the measured devices the cost network learned from
    batch             the samples per step the features were computed at
    hidden            width of the networks
    seed, state       the training seed and the networks' state dict
    weights_sha256    SHA-256 of the rest, tensors' bytes included (``weights_digest``);
                      files without it, from earlier versions, load
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from towerrec.planner.learned_cost import WEIGHTS_DIGEST, shard_features, weights_digest
from towerrec.planner.placement import Item, Loads
from towerrec.planner.stats import TableStats

__all__ = [
    "FEATURE_LAYOUT",
    "FORMAT",
    "VERSION",
    "CostSamples",
    "PlacementPolicy",
    "PolicyPlacer",
    "PolicySession",
    "PolicyWeights",
    "PolicyWeightsError",
    "Shards",
    "Task",
    "by_descending_cost",
    "cost_data_hash",
    "features",
    "item_features",
    "load_networks",
    "mlp",
    "padded_features",
    "task_features",
    "trained_weights",
    "training_tasks",
]

FORMAT = "towerrec-learned-sharding"
VERSION = 1
FEATURE_LAYOUT = (
    "log_rows",
    "cols",
    "log_ids",
    "log_lookup_values",
    "log_touched_rows",
    "log_touched_values",
    "hot1_share",
    "hot10_share",
)
NUM_FEATURES = len(FEATURE_LAYOUT)

Shards = Sequence[tuple[TableStats, int, int]]  # (stats, rows, cols) on one device
Task = tuple[list[TableStats], int]  # a training task: tables, devices


@dataclass
class CostSamples:
    """Measured costs a cost network learns from: devices and their kernel seconds
    (forward + backward), optionally (forward, backward) apart, and all-to-alls
    (output dims per rank, seconds); ``batch``: the samples per step they ran."""

    devices: list[Shards]
    seconds: list[float]
    split: list[tuple[float, float]] = field(default_factory=list)
    comm: list[tuple[tuple[int, ...], float]] = field(default_factory=list)
    batch: int = 2048

    def __post_init__(self) -> None:
        if len(self.devices) != len(self.seconds) or not self.devices:
            raise ValueError(
                f"cost data needs one measured time per device and at least one device "
                f"(got {len(self.devices)} devices, {len(self.seconds)} times)"
            )
        if any(not d for d in self.devices):
            raise ValueError("cost data holds a device without shards")
        if self.split and len(self.split) != len(self.devices):
            raise ValueError("cost data: split times need one (forward, backward) per device")

    def digest(self) -> str:
        h = hashlib.sha256(cost_data_hash(self.devices, self.seconds).encode())
        h.update(json.dumps([self.split, self.comm, self.batch]).encode())
        return h.hexdigest()


class PolicyWeightsError(ValueError):
    """A weights file that this code cannot use; says why and how to get a good one."""


def features(shards: Shards, batch: int) -> torch.Tensor:
    """Shard features [S, F] (``FEATURE_LAYOUT``) of ``shards`` at ``batch`` samples per step."""
    return torch.tensor(
        [shard_features(s, rows, cols, batch) for s, rows, cols in shards], dtype=torch.float32
    ).reshape(len(shards), NUM_FEATURES)


def item_features(items: Sequence[Item], batch: int) -> torch.Tensor:
    """Features [N, F] of planner items (shards of the task's tables)."""
    shards = []
    for it in items:
        assert it.stats is not None  # build_items sets stats
        shards.append((it.stats, it.rows[1] - it.rows[0], it.cols[1] - it.cols[0]))
    return features(shards, batch)


def task_features(tables: Sequence[TableStats], batch: int) -> torch.Tensor:
    """Features [T, F] of whole tables (a training task's)."""
    return features([(s, s.num_embeddings, s.embedding_dim) for s in tables], batch)


def padded_features(devices: Sequence[Shards], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [N, S, F] of N devices' shards, padded to the most shards S, and the
    mask [N, S] of the real ones."""
    most = max(len(d) for d in devices)
    feats = torch.zeros(len(devices), most, NUM_FEATURES)
    mask = torch.zeros(len(devices), most)
    for n, shards in enumerate(devices):
        if shards:
            feats[n, : len(shards)] = features(shards, batch)
            mask[n, : len(shards)] = 1
    return feats, mask


def by_descending_cost(single: Sequence[float]) -> list[int]:
    """Shard indices in descending single-shard cost (ties by index): the order a
    policy places shards in."""
    return sorted(range(len(single)), key=lambda i: (-single[i], i))


def mlp(inputs: int, hidden: int, out: int, last_relu: bool = True) -> nn.Sequential:
    """Linear, ReLU, Linear (and ReLU): the networks' building block."""
    layers: list[nn.Module] = [nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, out)]
    if last_relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def cost_data_hash(devices: Sequence[Shards], seconds: Sequence[float]) -> str:
    """sha256 of the measured devices (shapes, statistics, seconds), order included."""
    h = hashlib.sha256()
    for shards, t in zip(devices, seconds):
        entry = [[s.name, s.num_embeddings, s.embedding_dim, s.pooling_factor, s.hot1_share,
                  s.hot10_share, r, c] for s, r, c in shards]  # fmt: skip
        h.update(json.dumps([entry, float(t)]).encode())
    return h.hexdigest()


def training_tasks(
    tables: Sequence[TableStats],
    num_tasks: int,
    min_tables: int,
    max_tables: int,
    device_counts: Sequence[int],
    seed: int,
) -> list[tuple[list[TableStats], int]]:
    """``num_tasks`` (tables, devices) pairs: random subsets of ``tables`` of
    ``min..max`` tables, each on a device count drawn from ``device_counts``."""
    if not 1 <= min_tables <= max_tables <= len(tables):
        raise ValueError(
            f"need 1 <= min_tables {min_tables} <= max_tables {max_tables} <= {len(tables)} tables"
        )
    if not device_counts or min(device_counts) < 1:
        raise ValueError(f"device_counts must be >= 1, got {list(device_counts)}")
    rng = np.random.default_rng([seed, 41])
    out = []
    for _ in range(num_tasks):
        size = int(rng.integers(min_tables, max_tables + 1))
        chosen = sorted(rng.choice(len(tables), size, replace=False))
        out.append(([tables[i] for i in chosen], int(rng.choice(list(device_counts)))))
    return out


class PlacementPolicy(Protocol):
    """A trained policy's view for one task: the order to place items in, and the device
    for each (``ok``: the devices with room; ``loads``: what is placed so far)."""

    def order(self, items: Sequence[Item]) -> list[int]: ...

    def choose(self, index: int, item: Item, ok: np.ndarray, loads: Loads) -> int: ...


@dataclass
class PolicyWeights:
    """A trained policy and its header (see the module docstring)."""

    planner: str
    state: dict[str, torch.Tensor]
    trained_devices: tuple[int, ...]
    cost_data_sha256: str
    batch: int
    hidden: int
    seed: int
    extra: dict[str, Any] = field(default_factory=dict)

    def part(self, prefix: str) -> dict[str, torch.Tensor]:
        """The state of one network: the entries under ``prefix`` ("cost.", "policy."),
        without it."""
        return {k[len(prefix) :]: v for k, v in self.state.items() if k.startswith(prefix)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "planner": self.planner,
            "feature_layout": list(FEATURE_LAYOUT),
            "trained_devices": list(self.trained_devices),
            "cost_data_sha256": self.cost_data_sha256,
            "batch": self.batch,
            "hidden": self.hidden,
            "seed": self.seed,
            "extra": dict(self.extra),
            "state": dict(self.state),
        }

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        torch.save({**data, WEIGHTS_DIGEST: weights_digest(data)}, path)

    @staticmethod
    def from_dict(data: Mapping[str, Any], planner: str, where: str) -> PolicyWeights:
        retrain = (
            f"retrain it with `towerrec plan train-policy --planner {planner} --cost-data COSTS "
            "--out DIR`"
        )
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise PolicyWeightsError(f"{where} is not a {FORMAT} weights file; {retrain}")
        if data.get("version") != VERSION:
            raise PolicyWeightsError(
                f"{where} has format version {data.get('version')!r}, this code reads version "
                f"{VERSION}; {retrain}"
            )
        if data.get("planner") != planner:
            raise PolicyWeightsError(
                f"{where} holds {data.get('planner')!r} weights, not {planner!r}; pass the "
                f"{planner} weights file or {retrain}"
            )
        layout = tuple(data.get("feature_layout", ()))
        if layout != FEATURE_LAYOUT:
            raise PolicyWeightsError(
                f"{where} was trained on the feature layout {list(layout)}, this code computes "
                f"{list(FEATURE_LAYOUT)}; {retrain}"
            )
        missing = [k for k in ("state", "trained_devices", "batch", "hidden") if k not in data]
        if missing:
            raise PolicyWeightsError(f"{where} lacks {missing}; {retrain}")
        return PolicyWeights(
            planner,
            dict(data["state"]),
            tuple(int(d) for d in data["trained_devices"]),
            str(data.get("cost_data_sha256", "")),
            int(data["batch"]),
            int(data["hidden"]),
            int(data.get("seed", 0)),
            dict(data.get("extra", {})),
        )

    @staticmethod
    def load(path: str | Path, planner: str) -> PolicyWeights:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"{planner} weights file {str(path)!r} does not exist; train one with "
                f"`towerrec plan train-policy --planner {planner} --cost-data COSTS --out DIR`"
            )
        try:
            data = torch.load(path, weights_only=True)
        except Exception as e:  # torch raises several types for a file that is not its own
            raise PolicyWeightsError(
                f"{str(path)!r} is not a readable weights file ({type(e).__name__}: {e}); "
                f"retrain it with `towerrec plan train-policy --planner {planner} --cost-data COSTS "
                "--out DIR`"
            ) from None
        recorded = data.pop(WEIGHTS_DIGEST, None) if isinstance(data, dict) else None
        weights = PolicyWeights.from_dict(data, planner, repr(str(path)))  # format, version
        if recorded is not None and recorded != weights_digest(data):
            raise PolicyWeightsError(
                f"{str(path)!r} does not match its own {WEIGHTS_DIGEST}: the file is damaged "
                f"(its weights cannot be trusted); restore it from a copy or retrain it with "
                f"`towerrec plan train-policy --planner {planner} --cost-data COSTS --out DIR`"
            )
        return weights


def log_relative_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of log time (relative error), for positive predictions."""
    return torch.mean((torch.log(predicted + 1e-9) - torch.log(target)) ** 2)


def ms(seconds: Sequence[float]) -> torch.Tensor:
    """Seconds as milliseconds (the networks' unit), validated."""
    if not seconds or min(seconds) <= 0 or not all(math.isfinite(s) for s in seconds):
        raise ValueError("cost data needs at least one device, every time finite and > 0")
    return torch.tensor(seconds, dtype=torch.float32) * 1e3


# ------------------------------------------------------------------ networks and sessions
class CostEncoder(Protocol):
    """A cost network as a session sees it: shard encodings [..., H] of features [..., F]."""

    def embed(self, feats: torch.Tensor) -> torch.Tensor: ...


class ShardEncoder(Protocol):
    """A policy network as a session sees it: its own encoder of shard features."""

    @property
    def table_encoder(self) -> nn.Module: ...


C = TypeVar("C", bound=CostEncoder)
P = TypeVar("P", bound=ShardEncoder)
N = TypeVar("N", bound=nn.Module)
M = TypeVar("M", bound=nn.Module)


def trained_weights(
    planner: str,
    cost: nn.Module,
    policy: nn.Module,
    tasks: Sequence[Task],
    data: CostSamples,
    hidden: int,
    seed: int,
    extra: dict[str, Any],
) -> PolicyWeights:
    """The weights file of trained ``cost`` and ``policy`` networks (state under "cost."
    and "policy."), with the device counts of the training ``tasks``."""
    state = {f"cost.{k}": v for k, v in cost.state_dict().items()}
    state.update({f"policy.{k}": v for k, v in policy.state_dict().items()})
    return PolicyWeights(
        planner,
        state,
        tuple(sorted({count for _, count in tasks})),
        data.digest(),
        data.batch,
        hidden,
        seed,
        extra,
    )


def load_networks(weights: PolicyWeights, cost: N, policy: M) -> tuple[N, M]:
    """``cost`` and ``policy`` with the state of ``weights``, in eval mode."""
    cost.load_state_dict(weights.part("cost."))
    policy.load_state_dict(weights.part("policy."))
    return cost.eval(), policy.eval()


class PolicySession(ABC, Generic[C, P]):
    """One task's greedy placement by trained networks (a ``PlacementPolicy``): the
    shards' encodings by the cost network (``ce`` [T, H]) and by the policy's encoder
    (``pe`` [T, H]), summed per device (``sums``, ``tables`` [D, H]) as shards land,
    pinned ones too; ``scores`` gives the logits [D] of the devices for a shard, and
    ``choose`` takes the best with room."""

    def __init__(self, cost: C, policy: P, batch: int, items: Sequence[Item], world: int) -> None:
        self.cost, self.policy = cost, policy
        self.feats = item_features(items, batch)
        with torch.no_grad():
            self.ce = cost.embed(self.feats)
            self.pe = policy.table_encoder(self.feats)
        hidden = self.ce.shape[-1]
        self.sums = torch.zeros(world, hidden)
        self.tables = torch.zeros(world, hidden)
        self.seen = [0] * world

    @abstractmethod
    def order(self, items: Sequence[Item]) -> list[int]:
        """The order to place the items in (descending estimated cost)."""

    @abstractmethod
    def scores(self, index: int) -> torch.Tensor:
        """Logits [D] of the devices for item ``index``, under no_grad."""

    def add(self, device: int, index: int) -> None:
        """Item ``index`` landed on ``device``."""
        self.sums[device] += self.ce[index]
        self.tables[device] += self.pe[index]

    def choose(self, index: int, item: Item, ok: np.ndarray, loads: Loads) -> int:
        for d, members in enumerate(loads.on):  # what was placed since (pinned shards too)
            for j in members[self.seen[d] :]:
                self.add(d, j)
            self.seen[d] = len(members)
        with torch.no_grad():
            logits = self.scores(index).numpy()
        return int(np.argmax(np.where(ok, logits, -np.inf)))


class PolicyPlacer(Generic[C, P]):
    """Greedy placement by trained weights: the ``networks`` built once, a ``session``
    (a ``PolicySession``) started per task."""

    def __init__(
        self,
        weights: PolicyWeights,
        networks: Callable[[PolicyWeights], tuple[C, P]],
        session: Callable[[C, P, int, Sequence[Item], int], PlacementPolicy],
    ) -> None:
        self.weights = weights
        self.cost, self.policy = networks(weights)
        self._session = session

    def start(self, items: Sequence[Item], world: int) -> PlacementPolicy:
        return self._session(self.cost, self.policy, self.weights.batch, items, world)
