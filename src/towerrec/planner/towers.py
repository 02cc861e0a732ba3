"""Tower partitioner: split features into N towers that keep interacting features together.

Pure: an interaction-strength matrix ``S [F, F]`` (how much the model uses
each feature pair, learned by a short training run) and a cost per feature
in, feature groups out. The objective is the intra-tower interaction mass
``sum_{t} sum_{i<j in t} S_ij`` (equivalently: the least mass cut between
towers, which a compressing tower can only pass on in summary), under a
balance constraint on the towers' cost::

    max_t cost(t) <= (1 + tolerance) * C_lpt

where ``C_lpt`` is the largest tower of the cost-only partition (longest
processing time first), so the constraint is always satisfiable. Search:
several starts (the cost-only partition, a greedy affinity growth from
mutually weakly-interacting seeds, greedy growths in random orders), each
refined by steepest-ascent single moves and pairwise swaps between towers
(Kernighan-Lin style) that keep every tower non-empty and under the cap.

``cluster_features`` is the embedding-based alternative (the DMT paper's
tower partitioner builds towers from learned embeddings): one vector per
feature (``train.towers.learn_feature_representations``: the covariance of
its pooled embedding in a pilot run), a balanced k-means under the same cap
-- Lloyd iterations whose assignment step fills towers nearest-first within
the cap, from several k-means++ starts, then single moves and swaps that
lower the within-tower squared distance -- the least inertia wins.

Costs are pluggable: any ``[F]`` array; ``feature_costs`` is the default,
an equal mix of per-sample lookup bytes (pooling factor x dim) and table
memory, each normalised to sum 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

__all__ = [
    "FeatureStats",
    "TowerPartition",
    "cluster_features",
    "contiguous_partition",
    "cost_partition",
    "cross_tower_mass",
    "evaluate_partition",
    "feature_costs",
    "partition_features",
    "random_partition",
]


@dataclass(frozen=True)
class FeatureStats:
    """What the partitioner needs to know of a feature's table."""

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling_factor: float = 1.0
    bytes_per_value: int = 4

    @property
    def lookup_bytes(self) -> float:
        """Bytes of embedding rows read per sample."""
        return self.pooling_factor * self.embedding_dim * self.bytes_per_value

    @property
    def memory_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * self.bytes_per_value


@dataclass(frozen=True)
class TowerPartition:
    """Feature groups, one per tower, and how good they are."""

    groups: list[list[str]]
    intra_mass: float  # share of the total pair strength kept inside towers, in [0, 1]
    tower_costs: list[float]

    @property
    def cross_mass(self) -> float:
        return 1.0 - self.intra_mass

    @property
    def imbalance(self) -> float:
        """Largest tower cost over the mean (1 = perfectly balanced)."""
        mean = sum(self.tower_costs) / len(self.tower_costs)
        return max(self.tower_costs) / mean if mean > 0 else 1.0


def feature_costs(
    features: Sequence[FeatureStats], memory_weight: float = 0.5, count_weight: float = 0.0
) -> np.ndarray:
    """Default cost ``[F]``: lookup bytes, table memory and (``count_weight``) one unit per
    feature (what a tower must compress into its fixed output), each normalised to sum 1."""
    if not (0 <= memory_weight <= 1 and 0 <= count_weight <= 1 - memory_weight):
        raise ValueError(
            f"memory_weight ({memory_weight}) and count_weight ({count_weight}) must be >= 0 "
            "with a sum <= 1"
        )
    lookup = np.array([f.lookup_bytes for f in features], dtype=np.float64)
    memory = np.array([f.memory_bytes for f in features], dtype=np.float64)
    count = np.ones(len(features)) / len(features)
    lookup_weight = 1 - memory_weight - count_weight
    return cast(
        np.ndarray,
        lookup_weight * lookup / lookup.sum()
        + memory_weight * memory / memory.sum()
        + count_weight * count,
    )


def _symmetric(strength: np.ndarray, num_features: int) -> np.ndarray:
    s = np.abs(np.asarray(strength, dtype=np.float64))
    if s.shape != (num_features, num_features):
        raise ValueError(
            f"the strength matrix must be [F, F] = [{num_features}, {num_features}] for the "
            f"features given, got {list(s.shape)}"
        )
    if not np.isfinite(s).all():
        raise ValueError("the strength matrix has NaN or infinite entries; check the pilot run")
    s = s + s.T  # one triangle or both: the pair's total
    np.fill_diagonal(s, 0.0)
    return s


def _check(names: Sequence[str], num_towers: int, costs: np.ndarray | None = None) -> None:
    if num_towers < 1:
        raise ValueError(f"num_towers must be >= 1, got {num_towers}")
    if len(names) < num_towers:
        raise ValueError(
            f"cannot split {len(names)} features into {num_towers} non-empty towers; "
            f"use num_towers <= {len(names)}"
        )
    if costs is not None and (costs.shape != (len(names),) or (costs < 0).any()):
        raise ValueError(f"costs must be {len(names)} non-negative numbers, one per feature")


def _groups(names: Sequence[str], assign: np.ndarray, num_towers: int) -> list[list[str]]:
    return [[n for n, a in zip(names, assign) if a == t] for t in range(num_towers)]


def _lpt(costs: np.ndarray, num_towers: int) -> np.ndarray:
    """Longest processing time first: biggest feature into the lightest tower."""
    assign = np.empty(len(costs), dtype=np.int64)
    load = np.zeros(num_towers)
    count = np.zeros(num_towers, dtype=np.int64)
    for f in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        t = min(range(num_towers), key=lambda k: (count[k] > 0, load[k], k))
        assign[f], load[t], count[t] = t, load[t] + costs[f], count[t] + 1
    return assign


def cost_partition(names: Sequence[str], costs: np.ndarray, num_towers: int) -> list[list[str]]:
    """Balance cost only (LPT), ignoring interactions: the cost-only baseline."""
    costs = np.asarray(costs, dtype=np.float64)
    _check(names, num_towers, costs)
    return _groups(names, _lpt(costs, num_towers), num_towers)


def random_partition(names: Sequence[str], num_towers: int, seed: int = 0) -> list[list[str]]:
    """Features shuffled and dealt into towers of near-equal count: the random baseline."""
    _check(names, num_towers)
    order = np.random.default_rng(seed).permutation(len(names))
    assign = np.empty(len(names), dtype=np.int64)
    assign[order] = np.arange(len(names)) % num_towers
    return _groups(names, assign, num_towers)


def contiguous_partition(names: Sequence[str], num_towers: int) -> list[list[str]]:
    """Features in their given order, cut into ``num_towers`` runs of near-equal count."""
    _check(names, num_towers)
    return [list(part) for part in np.array_split(np.array(names, dtype=object), num_towers)]


def cross_tower_mass(
    strength: np.ndarray, names: Sequence[str], groups: Sequence[Sequence[str]]
) -> float:
    """Share of the total pair strength that falls between different towers."""
    s = _symmetric(strength, len(names))
    tower = {name: t for t, group in enumerate(groups) for name in group}
    assign = np.array([tower[n] for n in names])
    total = s.sum()
    return float(s[assign[:, None] != assign[None, :]].sum() / total) if total > 0 else 0.0


def evaluate_partition(
    strength: np.ndarray,
    costs: np.ndarray,
    names: Sequence[str],
    groups: Sequence[Sequence[str]],
) -> TowerPartition:
    index = {n: i for i, n in enumerate(names)}
    costs = np.asarray(costs, dtype=np.float64)
    return TowerPartition(
        groups=[list(g) for g in groups],
        intra_mass=1.0 - cross_tower_mass(strength, names, groups),
        tower_costs=[float(sum(costs[index[n]] for n in g)) for g in groups],
    )


def _grow(
    s: np.ndarray, costs: np.ndarray, order: Sequence[int] | np.ndarray, n: int, cap: float
) -> np.ndarray:
    """Seed the towers with the first n features of ``order``, then add each next feature to
    the tower it interacts with most among those with room (the lightest if none has)."""
    assign = np.full(len(costs), -1, dtype=np.int64)
    load = np.zeros(n)
    affinity = np.zeros((len(costs), n))  # affinity[f, t] = sum of S[f, g] over g in t
    for step, f in enumerate(order):
        if step < n:
            t = step
        else:
            room = load + costs[f] <= cap
            t = (
                int(np.argmax(np.where(room, affinity[f], -np.inf)))
                if room.any()
                else int(np.argmin(load))
            )
        assign[f], load[t] = t, load[t] + costs[f]
        affinity[:, t] += s[:, f]
    return assign


def _spread_seeds(s: np.ndarray, n: int) -> list[int]:
    """The feature with most total strength, then repeatedly the one least tied to the seeds."""
    seeds = [int(np.argmax(s.sum(1)))]
    while len(seeds) < n:
        tie = s[:, seeds].sum(1)
        tie[seeds] = np.inf
        seeds.append(int(np.argmin(tie)))
    rest = sorted(set(range(len(s))) - set(seeds), key=lambda f: -s[f].sum())
    return seeds + rest


def _refine(s: np.ndarray, costs: np.ndarray, assign: np.ndarray, n: int, cap: float) -> np.ndarray:
    """Steepest ascent over single moves and pair swaps that keep towers non-empty and <= cap."""
    assign = assign.copy()
    eps = 1e-12 * max(s.sum(), 1e-300)
    num = len(costs)
    for _ in range(4 * num * num):
        onehot = np.eye(n)[assign]  # [F, n]
        affinity = s @ onehot  # [F, n]
        load = costs @ onehot
        count = onehot.sum(0)
        own = affinity[np.arange(num), assign]  # [F]
        # single moves f -> t
        move_gain = affinity - own[:, None]
        move_ok = (load[None, :] + costs[:, None] <= cap) & (count[assign] > 1)[:, None]
        move_ok[np.arange(num), assign] = False
        move_gain = np.where(move_ok, move_gain, -np.inf)
        # swaps f <-> g between different towers
        to_g = affinity[:, assign]  # [F, F]: affinity of f to g's tower
        swap_gain = (to_g - own[:, None]) + (to_g.T - own[None, :]) - 2 * s
        new_f = load[assign][None, :] - costs[None, :] + costs[:, None]  # g's tower gets f
        new_g = load[assign][:, None] - costs[:, None] + costs[None, :]  # f's tower gets g
        swap_ok = (assign[:, None] != assign[None, :]) & (new_f <= cap) & (new_g <= cap)
        swap_gain = np.where(swap_ok, swap_gain, -np.inf)
        best_move, best_swap = move_gain.max(), swap_gain.max()
        if max(best_move, best_swap) <= eps:
            break
        if best_move >= best_swap:
            f, t = np.unravel_index(np.argmax(move_gain), move_gain.shape)
            assign[f] = t
        else:
            f, g = np.unravel_index(np.argmax(swap_gain), swap_gain.shape)
            assign[f], assign[g] = assign[g], assign[f]
    return assign


def partition_features(
    names: Sequence[str],
    strength: np.ndarray,
    costs: np.ndarray,
    num_towers: int,
    *,
    tolerance: float = 0.25,
    restarts: int = 8,
    seed: int = 0,
) -> TowerPartition:
    """Groups of ``names`` maximising intra-tower strength under the cost cap (module doc)."""
    costs = np.asarray(costs, dtype=np.float64)
    _check(names, num_towers, costs)
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    s = _symmetric(strength, len(names))
    lpt = _lpt(costs, num_towers)
    cap = (1 + tolerance) * max(costs @ np.eye(num_towers)[lpt]) + 1e-12
    rng = np.random.default_rng(seed)
    starts = [lpt, _grow(s, costs, _spread_seeds(s, num_towers), num_towers, cap)]
    starts += [
        _grow(s, costs, rng.permutation(len(names)), num_towers, cap) for _ in range(restarts)
    ]
    best, best_key = lpt, None
    for start in starts:
        assign = _refine(s, costs, start, num_towers, cap)
        onehot = np.eye(num_towers)[assign]
        load = costs @ onehot
        if load.max() > cap or (onehot.sum(0) == 0).any():
            continue  # a greedy start that could not be repaired under the cap
        intra = float(np.einsum("ft,fg,gt->", onehot, s, onehot))
        key = (-intra, load.max())
        if best_key is None or key < best_key:
            best, best_key = assign, key
    return evaluate_partition(strength, costs, names, _groups(names, best, num_towers))


def _unit_rows(representations: np.ndarray, num_features: int) -> np.ndarray:
    x = np.asarray(representations, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != num_features or x.shape[1] < 1:
        raise ValueError(
            f"the representations must be [F, D] with F = {num_features} (one row per feature), "
            f"got {list(x.shape)}"
        )
    if not np.isfinite(x).all():
        raise ValueError("the representations have NaN or infinite entries; check the pilot run")
    x = x - x.mean(0)  # what the features share says nothing about which belong together
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return np.where(norm > 0, x / np.where(norm > 0, norm, 1.0), 0.0)


def _inertia(x: np.ndarray, assign: np.ndarray, n: int) -> float:
    total = 0.0
    for t in range(n):
        members = x[assign == t]
        if len(members):
            total += float(((members - members.mean(0)) ** 2).sum())
    return total


def _kmeans_pp(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: each next centre drawn with probability ~ squared distance."""
    centres = [int(rng.integers(len(x)))]
    while len(centres) < n:
        d2 = ((x[:, None, :] - x[centres][None, :, :]) ** 2).sum(-1).min(1)
        total = d2.sum()
        p = d2 / total if total > 0 else np.full(len(x), 1.0 / len(x))
        centres.append(int(rng.choice(len(x), p=p)))
    return x[centres].copy()


def _capped_assign(
    x: np.ndarray, centres: np.ndarray, costs: np.ndarray, cap: float, rng: np.random.Generator
) -> np.ndarray:
    """Every tower first gets its nearest free feature, then (feature, tower) pairs are taken
    nearest first, each feature to the nearest tower it fits in (the lightest if none)."""
    n = len(centres)
    d2 = ((x[:, None, :] - centres[None, :, :]) ** 2).sum(-1)  # [F, n]
    assign = np.full(len(x), -1, dtype=np.int64)
    load = np.zeros(n)
    for t in rng.permutation(n):
        free = np.where(assign < 0)[0]
        f = free[np.argmin(d2[free, t])]
        assign[f], load[t] = t, load[t] + costs[f]
    for flat in np.argsort(d2, axis=None, kind="stable"):
        f, t = divmod(int(flat), n)
        if assign[f] < 0 and load[t] + costs[f] <= cap:
            assign[f], load[t] = t, load[t] + costs[f]
    for f in np.where(assign < 0)[0]:
        t = int(np.argmin(load))
        assign[f], load[t] = t, load[t] + costs[f]
    return assign


def _refine_inertia(
    x: np.ndarray, costs: np.ndarray, assign: np.ndarray, n: int, cap: float
) -> np.ndarray:
    """First-improvement single moves and swaps that lower the inertia, keep every tower
    non-empty and no tower over the cap (a start already over it only gets lighter)."""
    assign = assign.copy()
    best = _inertia(x, assign, n)
    eps = 1e-12 * max(best, 1e-300)
    improved = True
    while improved:
        improved = False
        load = np.array([costs[assign == t].sum() for t in range(n)])
        count = np.bincount(assign, minlength=n)
        candidates: list[tuple[int, ...]] = [
            (f, t) for f in range(len(x)) for t in range(n) if t != assign[f]
        ]
        candidates += [
            (f, g, -1)
            for f in range(len(x))
            for g in range(f + 1, len(x))
            if assign[f] != assign[g]
        ]
        for cand in candidates:
            trial = assign.copy()
            if len(cand) == 2:
                f, t = cand
                if count[assign[f]] == 1 or load[t] + costs[f] > cap:
                    continue
                trial[f] = t
            else:
                f, g = cand[0], cand[1]
                tf, tg = assign[f], assign[g]
                if load[tg] - costs[g] + costs[f] > max(cap, load[tg]) or load[tf] - costs[
                    f
                ] + costs[g] > max(cap, load[tf]):
                    continue
                trial[f], trial[g] = tg, tf
            value = _inertia(x, trial, n)
            if value < best - eps:
                assign, best, improved = trial, value, True
                break
    return assign


def cluster_features(
    names: Sequence[str],
    representations: np.ndarray,
    costs: np.ndarray,
    num_towers: int,
    *,
    tolerance: float = 0.25,
    restarts: int = 8,
    iterations: int = 20,
    seed: int = 0,
) -> TowerPartition:
    """Groups of ``names`` whose representation rows (``[F, D]``, one learned vector per
    feature; centred, then compared by direction) lie close together: a balanced k-means
    under ``partition_features``' cost cap (module doc), deterministic given ``seed``.

    The partition's ``intra_mass`` is measured on the features' affinity ``max(cos, 0)``
    (the share of it kept inside towers), as ``partition_features`` measures its strength."""
    costs = np.asarray(costs, dtype=np.float64)
    _check(names, num_towers, costs)
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if restarts < 1 or iterations < 1:
        raise ValueError(f"restarts ({restarts}) and iterations ({iterations}) must be >= 1")
    x = _unit_rows(representations, len(names))
    lpt = _lpt(costs, num_towers)
    cap = (1 + tolerance) * max(costs @ np.eye(num_towers)[lpt]) + 1e-12
    rng = np.random.default_rng(seed)
    starts = [lpt]
    for _ in range(restarts):
        centres = _kmeans_pp(x, num_towers, rng)
        assign = _capped_assign(x, centres, costs, cap, rng)
        for _ in range(iterations):
            centres = np.stack([x[assign == t].mean(0) for t in range(num_towers)])
            new = _capped_assign(x, centres, costs, cap, rng)
            if (new == assign).all():
                break
            assign = new
        starts.append(assign)
    best, best_key = lpt, None
    for start in starts:
        assign = _refine_inertia(x, costs, start, num_towers, cap)
        load = costs @ np.eye(num_towers)[assign]
        if load.max() > cap or (np.bincount(assign, minlength=num_towers) == 0).any():
            continue  # a start that could not be brought under the cap
        key = (_inertia(x, assign, num_towers), load.max())
        if best_key is None or key < best_key:
            best, best_key = assign, key
    affinity = np.triu(np.clip(x @ x.T, 0.0, None), 1)
    return evaluate_partition(affinity, costs, names, _groups(names, best, num_towers))
