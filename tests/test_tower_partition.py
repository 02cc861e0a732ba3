import itertools

import numpy as np
import pytest

from towerrec.planner.towers import (
    FeatureStats,
    cluster_features,
    contiguous_partition,
    cost_partition,
    cross_tower_mass,
    evaluate_partition,
    feature_costs,
    partition_features,
    random_partition,
)


def names(n):
    return [f"f{i}" for i in range(n)]


def planted_blocks(sizes, seed, noise=0.05):
    """A strength matrix with strong blocks of the given sizes, shuffled."""
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    label = np.repeat(np.arange(len(sizes)), sizes)
    perm = rng.permutation(n)
    label = label[perm]
    s = rng.random((n, n)) * noise + (label[:, None] == label[None, :]) * (0.5 + rng.random((n, n)))
    s = np.triu(s, 1)
    return s, label


def test_recovers_planted_blocks():
    for seed in range(5):
        s, label = planted_blocks([4, 4, 4], seed)
        result = partition_features(names(12), s, np.ones(12), 3, tolerance=0.0)
        found = {frozenset(g) for g in result.groups}
        planted = {frozenset(n for n, lab in zip(names(12), label) if lab == t) for t in range(3)}
        assert found == planted
        assert result.cross_mass == pytest.approx(cross_tower_mass(s, names(12), result.groups))
        assert result.cross_mass < 0.1


def brute_force_best(s, costs, n, cap):
    best = -1.0
    full = s + s.T
    for assign in itertools.product(range(n), repeat=len(costs)):
        assign = np.array(assign)
        if len(set(assign)) < n:
            continue
        loads = [costs[assign == t].sum() for t in range(n)]
        if max(loads) > cap + 1e-9:
            continue
        best = max(best, full[assign[:, None] == assign[None, :]].sum() / 2)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_matches_exhaustive_search_on_small_instances(seed):
    rng = np.random.default_rng(seed)
    f, n, tol = 8, 2, 0.3
    s = np.triu(rng.random((f, f)) ** 3, 1)
    costs = rng.uniform(0.5, 2.0, f)
    result = partition_features(names(f), s, costs, n, tolerance=tol)
    lpt_max = max(
        evaluate_partition(s, costs, names(f), cost_partition(names(f), costs, n)).tower_costs
    )
    cap = (1 + tol) * lpt_max
    assert max(result.tower_costs) <= cap + 1e-9
    assert result.intra_mass * s.sum() == pytest.approx(
        brute_force_best(s, costs, n, cap), rel=1e-9
    )


def test_balance_is_respected_and_beats_cost_only_and_random():
    rng = np.random.default_rng(7)
    f, n = 16, 4
    s = np.triu(rng.random((f, f)) ** 4, 1)
    costs = rng.uniform(0.2, 3.0, f)
    for tol in (0.0, 0.1, 0.5):
        result = partition_features(names(f), s, costs, n, tolerance=tol)
        cost_only = evaluate_partition(s, costs, names(f), cost_partition(names(f), costs, n))
        assert max(result.tower_costs) <= (1 + tol) * max(cost_only.tower_costs) + 1e-9
        assert result.intra_mass >= cost_only.intra_mass - 1e-12
        assert all(result.groups)
    randoms = [
        evaluate_partition(s, costs, names(f), random_partition(names(f), n, seed)).intra_mass
        for seed in range(20)
    ]
    loose = partition_features(names(f), s, costs, n, tolerance=10.0)
    assert loose.intra_mass > max(randoms)


def test_baselines():
    groups = random_partition(names(7), 3, seed=1)
    assert sorted(len(g) for g in groups) == [2, 2, 3]
    assert sorted(n for g in groups for n in g) == sorted(names(7))
    assert random_partition(names(7), 3, seed=1) == groups
    assert random_partition(names(7), 3, seed=2) != groups
    assert contiguous_partition(names(5), 2) == [["f0", "f1", "f2"], ["f3", "f4"]]
    # LPT: 5 | 4 | 3+2 (lightest tower gets the next biggest feature)
    assert cost_partition(names(4), np.array([5.0, 4.0, 3.0, 2.0]), 3) == [
        ["f0"],
        ["f1"],
        ["f2", "f3"],
    ]


def test_feature_costs_mix_lookup_and_memory():
    feats = [FeatureStats("a", 1000, 16, 1.0), FeatureStats("b", 10, 16, 3.0)]
    lookup_only = feature_costs(feats, memory_weight=0.0)
    memory_only = feature_costs(feats, memory_weight=1.0)
    np.testing.assert_allclose(lookup_only, [0.25, 0.75])
    np.testing.assert_allclose(memory_only, [1000 / 1010, 10 / 1010])
    np.testing.assert_allclose(feature_costs(feats), (lookup_only + memory_only) / 2)
    np.testing.assert_allclose(feature_costs(feats, 0.0, 1.0), [0.5, 0.5])  # count only
    with pytest.raises(ValueError, match="with a sum <= 1"):
        feature_costs(feats, 0.5, 0.6)


def test_errors_name_the_fix():
    s = np.zeros((3, 3))
    with pytest.raises(ValueError, match="cannot split 3 features into 4 non-empty towers"):
        partition_features(names(3), s, np.ones(3), 4)
    with pytest.raises(ValueError, match=r"must be \[F, F\] = \[3, 3\]"):
        partition_features(names(3), np.zeros((2, 2)), np.ones(3), 2)
    with pytest.raises(ValueError, match="NaN or infinite"):
        partition_features(names(3), np.full((3, 3), np.nan), np.ones(3), 2)
    with pytest.raises(ValueError, match="non-negative numbers, one per feature"):
        partition_features(names(3), s, -np.ones(3), 2)


def planted_vectors(sizes, seed, dim=8, noise=0.3):
    """Feature vectors around one random centre per cluster, shuffled; the cluster labels."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(sizes), dim)) * 3
    label = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    return centres[label] + rng.normal(size=(len(label), dim)) * noise, label


def planted_groups(label):
    return {
        frozenset(n for n, lab in zip(names(len(label)), label) if lab == t) for t in set(label)
    }


@pytest.mark.parametrize("seed", range(4))
def test_cluster_features_puts_planted_clusters_together(seed):
    x, label = planted_vectors([4, 4, 4], seed)
    result = cluster_features(names(12), x, np.ones(12), 3, tolerance=0.0, seed=seed)
    assert {frozenset(g) for g in result.groups} == planted_groups(label)
    assert result.tower_costs == [4.0, 4.0, 4.0]
    # uneven clusters fit once the cap allows the biggest: (1 + 0.25) * 4 = 5 features
    x, label = planted_vectors([5, 4, 3], seed + 10)
    result = cluster_features(names(12), x, np.ones(12), 3, tolerance=0.25, seed=seed)
    assert {frozenset(g) for g in result.groups} == planted_groups(label)
    # a rescaled, shifted copy is the same clustering (rows are centred, then directions)
    again = cluster_features(names(12), 5 * x + 2, np.ones(12), 3, tolerance=0.25, seed=seed)
    assert {frozenset(g) for g in again.groups} == planted_groups(label)


def test_cluster_features_respects_the_cost_cap_and_is_deterministic():
    rng = np.random.default_rng(3)
    x, label = planted_vectors([6, 3, 3], 3)
    costs = rng.uniform(0.5, 2.0, 12)
    lpt_max = max(
        evaluate_partition(
            np.zeros((12, 12)), costs, names(12), cost_partition(names(12), costs, 3)
        ).tower_costs
    )
    for tol in (0.0, 0.1, 0.3):
        result = cluster_features(names(12), x, costs, 3, tolerance=tol, seed=1)
        assert max(result.tower_costs) <= (1 + tol) * lpt_max + 1e-9
        assert all(result.groups) and sorted(n for g in result.groups for n in g) == sorted(
            names(12)
        )
        # the six-feature cluster weighs more than the cap: it cannot stay whole
        assert {frozenset(g) for g in result.groups} != planted_groups(label)
        assert cluster_features(names(12), x, costs, 3, tolerance=tol, seed=1) == result
    loose = cluster_features(names(12), x, costs, 3, tolerance=10.0, seed=1)
    assert {frozenset(g) for g in loose.groups} == planted_groups(label)


def test_cluster_features_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"must be \[F, D\] with F = 3 .* got \[2, 4\]"):
        cluster_features(names(3), np.zeros((2, 4)), np.ones(3), 2)
    with pytest.raises(ValueError, match="NaN or infinite"):
        cluster_features(names(3), np.full((3, 4), np.nan), np.ones(3), 2)
    with pytest.raises(ValueError, match="cannot split 3 features into 4 non-empty towers"):
        cluster_features(names(3), np.zeros((3, 4)), np.ones(3), 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        cluster_features(names(3), np.zeros((3, 4)), np.ones(3), 2, restarts=0)
