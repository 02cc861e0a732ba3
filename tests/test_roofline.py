"""The physical bounds of bench/roofline.py and the bf16 quality verdict of bench precision."""

import pytest
import torch

from towerrec.bench.precision import quality_verdict
from towerrec.bench.roofline import (
    Roofline,
    embedding_step_bytes,
    layer_matmul_seconds,
    layer_matmuls,
    matmul_peak,
    memory_bandwidth,
)


def test_embedding_step_bytes_counts_the_gather_and_the_update():
    # 10 lookups of dim 4 (160 bytes) + 3 rows of weights and one state float, read and written
    assert embedding_step_bytes(10, 3, 4, 1) == 10 * 4 * 4 + 2 * 3 * 5 * 4


def test_roofline_time_adds_the_dense_and_the_memory_work():
    roof = Roofline("cpu", "float32", matmul_flops=1e9, bandwidth=1e8)
    assert roof.seconds(2e9, 5e7) == pytest.approx(2.5)
    assert roof.as_dict()["matmul_peak_gflops"] == 1.0


def test_measured_peaks_are_positive_and_finite(one_thread):
    flops = matmul_peak("cpu", torch.float32, seconds=0.01, shapes=((64, 64, 64),))
    bandwidth = memory_bandwidth("cpu", seconds=0.01, nbytes=1 << 20)
    assert 0 < flops < float("inf") and 0 < bandwidth < float("inf")


def test_layer_matmuls_are_a_steps_three_products_on_the_mlps_padded_widths():
    # 13 inputs: no padding (below 64); 67: padded to 72, as the step's MLP runs it
    layers = [(13, 32, False), (67, 24, True)]
    ops = dict(layer_matmuls(layers, batch=16, dtype=torch.float32))
    assert list(ops) == [
        "layer 0 13x32 forward",
        "layer 0 13x32 weight grad",
        "layer 1 67x24 forward",
        "layer 1 67x24 weight grad",
        "layer 1 67x24 input grad",
    ]
    shapes = {name: tuple(op().shape) for name, op in ops.items()}
    assert shapes["layer 0 13x32 forward"] == (16, 32)
    assert shapes["layer 0 13x32 weight grad"] == (32, 13)
    assert shapes["layer 1 67x24 forward"] == (16, 24)
    assert shapes["layer 1 67x24 weight grad"] == (24, 72)
    assert shapes["layer 1 67x24 input grad"] == (16, 72)
    assert ops["layer 1 67x24 forward"]().dtype == torch.float32
    assert dict(layer_matmuls(layers, 16, torch.bfloat16))["layer 0 13x32 forward"]().dtype == (
        torch.bfloat16
    )


def test_layer_matmul_seconds_sums_each_products_time():
    # a clock that moves one second a reading: each product is timed over one call of one
    # second, so the sum is the number of products
    ticks = iter(range(10**6))
    seconds = layer_matmul_seconds(
        [(13, 32, False), (67, 24, True)], 16, torch.float32, seconds=0.5,
        clock=lambda: float(next(ticks)),
    )  # fmt: skip
    assert seconds == pytest.approx(5.0)


def _runs(aucs):
    return {"auc_std": float(torch.tensor(aucs).std()), "per_seed": [{"auc": a} for a in aucs]}


def test_quality_verdict_pairs_the_seeds():
    fp32 = _runs([0.70, 0.72, 0.71])
    assert quality_verdict(_runs([0.7001, 0.7202, 0.7099]), fp32)["within_noise"]
    shifted = quality_verdict(_runs([0.69, 0.71, 0.70]), fp32)  # 0.01 lower on every seed
    assert shifted["auc_bf16_minus_fp32"] == pytest.approx(-0.01)
    assert not shifted["within_noise"]
    assert not quality_verdict({"auc": 0.7}, {"auc": 0.7})["within_noise"]  # one seed: no verdict
    assert shifted["not_worse"]  # 0.01 below: within fp32's spread over seeds (0.01)
    assert not quality_verdict(_runs([0.68, 0.70, 0.69]), fp32)["not_worse"]  # 0.02 below
    gain = quality_verdict(_runs([0.7101, 0.7302, 0.7199]), fp32)  # 0.01 higher on every seed
    assert gain["not_worse"] and not gain["within_noise"]
    assert "test_auc_bf16_minus_fp32" not in gain  # no test split: no test difference


def test_quality_verdict_reads_the_test_split_when_there_is_one():
    fp32, bf16 = _runs([0.70, 0.72, 0.71]), _runs([0.70, 0.72, 0.71])
    for run, tests in ((fp32, [0.65, 0.66, 0.67]), (bf16, [0.64, 0.66, 0.66])):
        run["test_auc"] = sum(tests) / 3
        for seed, t in zip(run["per_seed"], tests):
            seed["test_auc"] = t
    verdict = quality_verdict(bf16, fp32)
    assert verdict["test_auc_bf16_minus_fp32"] == pytest.approx(-0.00667, abs=1e-5)
