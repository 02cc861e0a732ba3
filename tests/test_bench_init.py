"""``towerrec bench init``: variants are applied as written and scored on the test
split with the best validation's weights; unknown data sets and variants are refused."""

import pytest

from towerrec.bench import init as bench_init

TINY = {"epochs": 2, "patience": 1, "synthetic_steps": 20, "threads": 1}


def test_unknown_data_or_variant_is_refused_with_the_choices():
    settings = {**TINY, "overrides": ()}
    with pytest.raises(ValueError, match=r"--data frappe: choose among movielens, context"):
        bench_init.run_init_benchmark(("frappe",), ("default",), (0,), settings)
    with pytest.raises(ValueError, match=r"--variants \(empty\): choose among default"):
        bench_init.run_init_benchmark(("synthetic",), (), (0,), settings)


def test_each_variant_runs_with_its_init_and_reports_mean_and_std(monkeypatch, tmp_path):
    seen = []
    real_train = bench_init.__dict__.get("train")
    assert real_train is None  # imported inside _run_one (the CLI's help stays light)

    def fake_train(config, out):
        seen.append((config.embedding.init, config.embedding.init_scale, config.train.seed))
        auc = 0.7 + config.train.seed / 100 + (config.embedding.init == "normal_scale") / 10
        metrics = {"auc": auc, "logloss": 0.5}
        return {"best_validation": metrics, "best_step": 10, "steps": 20}

    monkeypatch.setattr("towerrec.workflows.training.train", fake_train)
    settings = {**TINY, "overrides": ("train.batch_size=512",)}
    variants = ("uniform_rows-adagrad", "normal_0.01-adagrad")
    result = bench_init.run_init_benchmark(("synthetic",), variants, (0, 2), settings, tmp_path)
    assert seen == [
        ("uniform_rows", 0.01, 0),
        ("uniform_rows", 0.01, 2),
        ("normal_scale", 0.01, 0),
        ("normal_scale", 0.01, 2),
    ]
    synthetic = result["datasets"]["synthetic"]
    assert synthetic["variants"]["uniform_rows-adagrad"]["test_auc"] == {
        "mean": 0.71,
        "std": pytest.approx(0.01414, abs=1e-5),
    }
    assert synthetic["best"] == "normal_0.01-adagrad"
    assert synthetic["within_noise_of_best"] == ["normal_0.01-adagrad"]
