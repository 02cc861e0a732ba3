"""The zoo benchmarks end to end through the CLI, tiny: the JSON shape and the FLOP matching."""

import json
import statistics

import pytest
from conftest import run_cli

TINY = [
    "--steps",
    "3",
    "--batch-size",
    "64",
    "--set",
    "data.synthetic.eval_samples=512",
    "--set",
    "data.synthetic.num_embeddings=[40, 30, 50]",
    "--set",
    "data.synthetic.pooling_factors=[1, 2, 1]",
]


def bench(*args, returncode=0):
    result = run_cli("bench", *args, "--json", *TINY)
    assert result.returncode == returncode, result.stderr
    if returncode:
        return result.stderr
    return json.loads(result.stdout)  # stdout holds nothing but the JSON


def test_unknown_variant_is_a_user_error():
    stderr = bench("embeddings-memory", "--variants", "qr_9x", returncode=2)
    assert stderr.startswith("error: unknown variants ['qr_9x']; choose from full, hash_2x")


@pytest.mark.slow
def test_models_benchmark_matches_flops():
    out = bench("models")
    target = out["target_flops_per_sample"]
    assert set(out["results"]) == {"dlrm", "dcn", "wukong"}
    for name, r in out["results"].items():
        assert abs(r["flops_per_sample"] - target) <= 0.05 * target, name
        assert 0 <= r["auc"] <= 1


def test_optimizers_benchmark_json():
    out = bench("optimizers", "--variants", "rowwise_adagrad,cf_sgd")
    assert (
        out["benchmark"] == "optimizers"
        and out["overrides"][0] == "data.synthetic.eval_samples=512"
    )
    results = out["results"]
    assert set(results) == {"rowwise_adagrad", "cf_sgd"}
    assert results["cf_sgd"]["backend"] == "torch"
    assert results["rowwise_adagrad"]["num_embedding_params"] == (40 + 30 + 50) * 16


def test_seeds_give_mean_std_and_paired_differences():
    out = bench("embeddings-memory", "--variants", "full,qr_add_4x", "--seeds", "2")
    assert out["seeds"] == 2
    full, qr = out["results"]["full"], out["results"]["qr_add_4x"]
    for r in (full, qr):
        aucs = [s["auc"] for s in r["per_seed"]]
        assert [s["seed"] for s in r["per_seed"]] == [0, 1]
        assert aucs[0] != aucs[1]  # another init and data order
        assert r["auc"] == pytest.approx(statistics.fmean(aucs), abs=1e-5)
        assert r["auc_std"] == pytest.approx(statistics.stdev(aucs), abs=1e-5)
        logs = [s["logloss"] for s in r["per_seed"]]
        assert r["logloss_std"] == pytest.approx(statistics.stdev(logs), abs=1e-5)
    diffs = [q["auc"] - f["auc"] for q, f in zip(qr["per_seed"], full["per_seed"])]
    assert qr["auc_minus_full"] == pytest.approx(statistics.fmean(diffs), abs=1e-5)
    assert qr["auc_minus_full_std"] == pytest.approx(statistics.stdev(diffs), abs=1e-5)


def test_bad_seed_count_is_a_user_error(tmp_path):
    from towerrec.bench.zoo import Sweep

    with pytest.raises(ValueError, match="--seeds must be >= 1, got 0"):
        Sweep(1, 64, "cpu", tmp_path, seeds=0)


def test_flops_are_matched_on_movielens_too(tmp_path):
    from towerrec.bench.zoo import HIGH_ORDER, Sweep, _matched_width

    sweep = Sweep(1, 64, "cpu", tmp_path, ("data.source=movielens",))
    target = sweep.flops([*HIGH_ORDER, "model.name=wukong"])
    for extra in (["model.name=dlrm"], ["model.name=dcn", "model.dcn.rank=16"]):
        _, flops = _matched_width(sweep, [*HIGH_ORDER, *extra], target)
        assert abs(flops - target) <= 0.01 * target, extra
    # the synthetic schema (13 dense, 9 tables) gives another count: the data's schema is used
    assert Sweep(1, 64, "cpu", tmp_path).flops([*HIGH_ORDER, "model.name=wukong"]) != target


def test_the_benchmark_threads_reach_every_run(one_thread):
    from towerrec.bench.zoo import run_zoo_benchmark

    seen = {}

    def benchmark(sweep):
        seen["threads"] = sweep.config([]).train.threads
        return {}

    run_zoo_benchmark("precision", 1, 8, threads=1, benchmark=benchmark)
    assert seen["threads"] == 1  # not 0, which lets a run take every core


def test_steps_zero_trains_the_configs_own_length_and_batch(tmp_path):
    from towerrec.bench.zoo import Sweep
    from towerrec.config import load_config
    from towerrec.config.recipes import resolve_config_file

    with pytest.raises(ValueError, match=r"--steps -1 .* or 0 for the config's own"):
        Sweep(-1, 64, "cpu", tmp_path)
    quick = resolve_config_file("quick")
    extra = ("data.synthetic.eval_samples=512",)
    own = Sweep(0, 0, "cpu", tmp_path, extra, base=quick).run_one([])
    assert own["steps"] == load_config(quick).train.steps
    assert own["best_step"] is not None  # validated during training, as the config says
    fixed = Sweep(5, 64, "cpu", tmp_path, extra, base=quick).run_one([])
    assert fixed["steps"] == 5
