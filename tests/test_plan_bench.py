"""Calibration, measured device costs, the planner benchmark and TorchRec plan conversion."""

import json

import numpy as np
import pytest
from conftest import needs_torchrec

from towerrec.calibration import (
    FEATURES,
    analytic_device_seconds,
    calibrate,
    fit_kernel,
    kernel_features,
    make_ids,
)
from towerrec.modules.tables import TableConfig
from towerrec.planner.cost import CostConstants, CostModel
from towerrec.planner.search import evaluate_plan, plan_tables
from towerrec.planner.stats import TableStats
from towerrec.planner.suites import dlrm_like_suite
from towerrec.planner.topology import topology_preset
from towerrec.sharding import ShardingPlan, plan_table


def test_make_ids_follow_the_statistics():
    stats = TableStats("t", 1000, 8, pooling_factor=3, pooling_p50=3, pooling_p99=3,
                       pooling_max=3, hot1_share=0.3, hot10_share=0.6)  # fmt: skip
    lengths, ids = make_ids(stats, 20_000, 1000, np.random.default_rng(0))
    assert lengths.mean() == pytest.approx(3, rel=0.02) and lengths.min() >= 1
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
    assert counts[:10].sum() / counts.sum() == pytest.approx(0.3, abs=0.02)
    assert counts[:100].sum() / counts.sum() == pytest.approx(0.6, abs=0.02)


def test_kernel_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(40, len(FEATURES)))) * np.array([3, 8, 1e5, 1e7, 1e4, 1e7])
    truth = np.array([1e-4, 0.0, 5e-8, 2e-10, 0.0, 1e-10])
    coef = fit_kernel(x, x @ truth)
    assert coef == pytest.approx(truth, rel=1e-6, abs=1e-15)
    assert (fit_kernel(x, x @ truth + 1e-3) >= 0).all()


def test_analytic_device_seconds_matches_the_feature_terms():
    constants = CostConstants(lookup_bandwidth=2e9, update_bandwidth=1e9, lookup_s_per_id=1e-8,
                              update_s_per_row=2e-8, kernel_overhead_s=1e-4,
                              table_overhead_s=1e-5)  # fmt: skip
    model = CostModel(topology_preset("cpu", 1, 4), constants, 256)
    tables = dlrm_like_suite(5, seed=2)
    shards = [(s, min(s.num_embeddings, 1000), s.embedding_dim) for s in tables]
    f = kernel_features(shards, 1024)
    coef = np.array([1e-4, 1e-5, 1e-8, 1 / 2e9, 2e-8, 1 / 1e9])
    assert analytic_device_seconds(model, shards, 1024) == pytest.approx(float(f @ coef))


@pytest.mark.multiprocess
def test_calibrate_writes_loadable_constants(tmp_path):
    result = calibrate(num_groups=4, batch=256, reps=1)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(result))
    constants = CostConstants.load(path)
    assert constants.source.startswith("calibrated")
    assert constants.intra_host_bandwidth > 0 and len(result["all_to_all"]) == 4
    assert len(result["kernel_samples"]) == 4
    # The calibrated model plans.
    model = CostModel(topology_preset("cpu", 1, 2), constants, 256)
    plan_tables(dlrm_like_suite(10), model, "lpt").plan.validate(
        [TableConfig(s.name, s.num_embeddings, s.embedding_dim) for s in dlrm_like_suite(10)]
    )


def test_evaluate_plan_agrees_with_the_planner():
    suite = dlrm_like_suite(30, seed=5)
    model = CostModel(topology_preset("gpu", 2, 2), None, 256)
    result = plan_tables(suite, model, "search")
    again = evaluate_plan(result.plan, suite, model)
    assert again.device_costs == pytest.approx(result.device_costs)
    assert again.device_memory == pytest.approx(result.device_memory)


def test_plan_benchmark_small_run():
    from towerrec.bench.plan import run_plan_benchmark

    result = run_plan_benchmark(tasks=3, torchrec_tasks=0, measured_tasks=0, full=False)
    planners = result["tasks"]["planners"]
    greedy = [v["mean_ratio_to_best_greedy"] for k, v in planners.items()
              if k.startswith("greedy") or k == "random"]  # fmt: skip
    assert min(greedy) >= 1.0 - 1e-9  # the best greedy of each task defines 1.0
    assert planners["search"]["mean_ratio_to_best_greedy"] < 1.0
    assert result["targets"]["search_mean_ratio_to_best_greedy"] == pytest.approx(
        planners["search"]["mean_ratio_to_best_greedy"]
    )


# ------------------------------------------------------------------ TorchRec
TABLES = [TableConfig("a", 10, 8), TableConfig("b", 7, 4), TableConfig("c", 20, 8)]


@needs_torchrec
def test_torchrec_plan_roundtrip():
    from towerrec.interop.torchrec_plan import from_torchrec_plan, to_torchrec_plan

    plan = ShardingPlan(
        4,
        hosts=2,
        tables={
            "a": plan_table(TABLES[0], "column_wise", [3, 1]),
            "b": plan_table(TABLES[1], "table_wise", [2]),
            "c": plan_table(TABLES[2], "row_wise", [0, 1, 2, 3]),
        },
    )
    exported = to_torchrec_plan(plan, TABLES, module_path="sparse")
    params = exported.plan["sparse"]
    assert params["a"].sharding_type == "column_wise" and params["a"].ranks == [3, 1]
    shards = params["c"].sharding_spec.shards
    assert [m.shard_offsets for m in shards] == [[0, 0], [5, 0], [10, 0], [15, 0]]
    assert [m.placement.rank() for m in shards] == [0, 1, 2, 3]
    assert from_torchrec_plan(exported, "sparse", 4, 2) == plan
    with pytest.raises(ValueError, match="no module 'other'"):
        from_torchrec_plan(exported, "other", 4)


@needs_torchrec
def test_torchrec_planner_plan_is_scored_by_our_model():
    from towerrec.bench.plan import torchrec_planner_plan

    suite = dlrm_like_suite(12, seed=7)
    model = CostModel(topology_preset("gpu", 1, 4), None, 256)
    plan = torchrec_planner_plan(suite, model)
    result = evaluate_plan(plan, suite, model)
    assert result.max_cost > 0 and len(result.device_costs) == 4
