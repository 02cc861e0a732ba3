"""The zoo benchmarks end to end through the CLI, tiny: the JSON shape and the FLOP matching."""

import json

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
