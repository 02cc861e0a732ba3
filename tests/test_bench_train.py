"""``towerrec bench train``'s report: each row's roofline at its precision (with fake peaks,
so the arithmetic is checked and nothing depends on timing), its ratios against TorchRec's
faster configuration, the default row with what ``auto`` resolved to, and the phase
profile of ``--profile``. No timing is asserted."""

import argparse
import re
import time

import pytest
import torch
from conftest import needs_fbgemm

from towerrec.bench.roofline import Roofline
from towerrec.bench.train import (
    BENCHMARK,
    DEFAULT_ROW,
    _towerrec_row,
    default_choices,
    make_batches,
    run_train_benchmark,
)
from towerrec.bench.train_profile import WALL_PHASES, backward_phase, wall_phase_table
from towerrec.bench.train_report import (
    StepWork,
    add_peer_ratios,
    batch_embedding_bytes,
    roofline_fields,
)
from towerrec.hardware import cpu_flags
from towerrec.modules.native import fused

SHAPE = {
    "num_dense": 5,
    "num_tables": 3,
    "num_embeddings": [40, 50, 60],
    "pooling_factors": [1, 2, 1],
    "embedding_dim": 8,
    "bottom_mlp": [16, 8],
    "top_mlp": [8, 1],
}
PEAKS = {torch.float32: 1e9, torch.bfloat16: 4e9}  # fake matmul FLOP/s per dtype


def fake_roofline(dtype, clock):
    # the CPU-clock bounds twice the wall-clock ones, to tell them apart
    scale = 1.0 if clock is time.perf_counter else 2.0
    return Roofline("cpu", str(dtype), PEAKS[dtype] * scale, 1e8 * scale)


MATMULS_S = {torch.float32: 0.003, torch.bfloat16: 0.001}  # fake seconds of the step's matmuls
SHAPE_LAYERS = [(5, 16, False), (16, 8, True), (4 * 3 // 2 + 8, 8, True), (8, 1, True)]


def fake_matmuls(layers, batch, dtype):
    assert list(layers) == SHAPE_LAYERS and batch == 16  # SHAPE's MLPs at the run's batch
    return MATMULS_S[dtype]


def test_roofline_is_flops_at_the_peak_plus_bytes_at_the_bandwidth():
    work = StepWork(flops=2e9, embedding_bytes=5e7)
    wall = Roofline("cpu", "float32", matmul_flops=1e9, bandwidth=1e8)  # 2 s + 0.5 s
    cpu = Roofline("cpu", "float32", matmul_flops=4e9, bandwidth=1e9)  # 0.5 s + 0.05 s
    got = roofline_fields(work, step_s=5.0, cpu_s=1.1, wall=wall, cpu=cpu)
    assert got == {
        "roofline_ms": 2500.0,
        "roofline_fraction": 0.5,
        "cpu_roofline_ms": 550.0,
        "cpu_roofline_fraction": 0.5,
    }
    # with the step's matmuls timed alone (0.75 s): the shapes' bound adds the bytes (0.5 s)
    shapes = roofline_fields(work, step_s=5.0, cpu_s=1.1, wall=wall, cpu=cpu, matmuls_s=0.75)
    assert shapes == {
        **got,
        "shapes_matmul_ms": 750.0,
        "shapes_bound_ms": 1250.0,
        "shapes_bound_fraction": 0.25,
    }


def test_embedding_bytes_count_every_lookup_and_each_distinct_row_per_table():
    (batch,) = make_batches(SHAPE, 6, count=1)
    values = batch.sparse.values()
    assert values.numel() == 6 + 12 + 6  # table 1 has two ids a bag
    per_table = values.split([6, 12, 6])
    distinct = sum(torch.unique(v).numel() for v in per_table)
    # lookups x dim floats gathered; each distinct row's 8 weights and 1 state read and written
    assert batch_embedding_bytes([batch], 8) == 4 * (24 * 8 + 2 * distinct * 9)


def test_ratios_against_the_faster_torchrec_by_wall_and_by_cpu_time():
    results = {
        "towerrec_torch": {"samples_per_s": 300.0, "cpu_ms_per_step": 10.0},
        "torchrec": {"samples_per_s": 100.0, "cpu_ms_per_step": 15.0},
        "torchrec_no_dmp": {"samples_per_s": 150.0, "cpu_ms_per_step": 20.0},
        "towerrec_fbgemm": {"skipped": "fbgemm_gpu is not installed"},
    }
    header = add_peer_ratios(results)
    assert header["torchrec_reference"] == "torchrec_no_dmp"  # more samples/s
    assert header["cpu_torchrec_reference"] == "torchrec"  # less CPU per step
    assert results["towerrec_torch"]["vs_torchrec"] == 2.0
    assert results["towerrec_torch"]["cpu_vs_torchrec"] == 1.5
    assert header["ratios"]["towerrec_torch/torchrec_no_dmp"] == 2.0
    assert "vs_torchrec" not in results["towerrec_fbgemm"]
    # with TorchRec alone beside towerrec, the strongest peer is its fastest row
    assert header["strongest_peer"] == "torchrec_no_dmp"
    assert results["towerrec_torch"]["vs_strongest_peer"] == 2.0


def test_the_strongest_peer_is_the_fastest_row_of_any_other_system_at_any_precision():
    results = {
        "towerrec_torch": {"samples_per_s": 300.0, "cpu_ms_per_step": 10.0},
        "towerrec_default": {"samples_per_s": 600.0, "cpu_ms_per_step": 5.0},
        "torchrec": {"samples_per_s": 100.0, "cpu_ms_per_step": 15.0},
        "torchrec_bf16": {"samples_per_s": 200.0, "cpu_ms_per_step": 12.0},
        "plain_fused": {"samples_per_s": 150.0, "cpu_ms_per_step": 8.0},
        "plain_per_table_bf16": {"samples_per_s": 400.0, "cpu_ms_per_step": 9.0},
    }
    header = add_peer_ratios(results)
    assert header["torchrec_reference"] == "torchrec_bf16"  # TorchRec's fastest, in bf16
    assert header["cpu_torchrec_reference"] == "torchrec_bf16"
    assert header["strongest_peer"] == "plain_per_table_bf16"  # towerrec's rows never count
    assert header["cpu_strongest_peer"] == "plain_fused"
    assert results["towerrec_default"]["vs_torchrec"] == 3.0
    assert results["towerrec_default"]["vs_strongest_peer"] == 1.5
    assert results["towerrec_default"]["cpu_vs_strongest_peer"] == 1.6
    assert results["plain_per_table_bf16"]["vs_strongest_peer"] == 1.0


def test_each_row_reports_its_precisions_roofline_and_the_default_row_its_choices(one_thread):
    out = run_train_benchmark(
        steps=2,
        warmup=1,
        backends="torch",
        torchrec=False,
        batch_size=16,
        shape=SHAPE,
        rounds=2,
        precisions=("fp32", "bf16"),
        measure=fake_roofline,
        measure_matmuls=fake_matmuls,
    )
    results = out["results"]
    peers = {"plain_fused", "plain_fused_bf16", "plain_per_table", "plain_per_table_bf16"}
    assert set(results) == {"towerrec_torch", "towerrec_torch_bf16", DEFAULT_ROW} | peers
    for name in peers:
        assert results[name]["precision"] == ("bf16" if name.endswith("_bf16") else "fp32")
        assert results[name]["backend"].startswith("plain PyTorch")
    fastest = max(peers, key=lambda n: results[n]["samples_per_s"])
    assert out["strongest_peer"] == fastest
    assert results[DEFAULT_ROW]["vs_strongest_peer"] == round(
        results[DEFAULT_ROW]["samples_per_s"] / results[fastest]["samples_per_s"], 3
    )
    flops, nbytes = out["train_flops_per_step"], out["embedding_bytes_per_step"]
    assert nbytes == round(batch_embedding_bytes(make_batches(SHAPE, 16), 8))
    for name in ("towerrec_torch", "towerrec_torch_bf16", DEFAULT_ROW):
        row = results[name]
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[row["precision"]]
        wall_s = flops / PEAKS[dtype] + nbytes / 1e8
        assert row["roofline_ms"] == pytest.approx(wall_s * 1e3, abs=1e-3)
        assert row["cpu_roofline_ms"] == pytest.approx(wall_s / 2 * 1e3, abs=1e-3)
        assert row["roofline_fraction"] == pytest.approx(wall_s * 1e3 / row["step_ms"], rel=1e-2)
        shapes_s = MATMULS_S[dtype] + nbytes / 1e8
        assert row["shapes_matmul_ms"] == MATMULS_S[dtype] * 1e3
        assert row["shapes_bound_ms"] == pytest.approx(shapes_s * 1e3, abs=1e-3)
        assert row["shapes_bound_fraction"] == pytest.approx(
            shapes_s * 1e3 / row["step_ms"], rel=1e-2
        )
        assert row["backend"] == "torch" or name == DEFAULT_ROW
    assert results["towerrec_torch_bf16"]["precision"] == "bf16"
    default = results[DEFAULT_ROW]
    # the suite runs with TOWERREC_MEASURE=0: auto follows the rule, and the precision's
    # auto is fp32 without timing (by the rule where the CPU has bf16 units, else the only one)
    assert default["chosen"]["backend"]["value"] == default["backend"]
    precision = default["chosen"]["precision"]
    assert (precision["value"], precision["ms_per_step"], precision["took_s"]) == ("fp32", {}, 0.0)
    assert (precision["how"], precision["why"]) in (
        ("rule", "TOWERREC_MEASURE=0"),
        ("only", "no bf16 units on this CPU (no amx_bf16, avx512_bf16 or AArch64 bf16)"),
    )
    assert out["default_row"] == DEFAULT_ROW
    assert set(out["rooflines"]) == {"fp32", "bf16"}
    assert out["rooflines"]["bf16"]["wall"]["matmul_peak_gflops"] == 4.0
    assert out["shapes_matmul_ms"] == {"fp32": 3.0, "bf16": 1.0}
    machine = out["machine"]
    assert machine["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(machine["cpu_flags"]) <= cpu_flags() and "cpu" in machine
    if fused is None:
        assert machine["native_lanes"] is None
    else:  # 16 lanes exactly where the CPU has AVX-512, 8 with AVX2, else 4
        flags = cpu_flags()
        assert machine["native_lanes"] == (
            16 if "avx512f" in flags else 8 if "avx2" in flags else 4
        )


def test_profile_splits_the_step_into_its_phases(one_thread):
    out = run_train_benchmark(
        steps=1,
        warmup=1,
        backends="torch",
        torchrec=False,
        plain=False,
        batch_size=16,
        shape=SHAPE,
        rounds=1,
        default_row=False,
        profile_steps=2,
        measure=fake_roofline,
        measure_matmuls=fake_matmuls,
    )
    assert out["default_row"] is None and DEFAULT_ROW not in out["results"]
    profile = out["profile"]["towerrec_torch"]
    phases = profile["phases_ms"]
    for phase in (
        "embedding_fwd", "bottom_mlp_fwd", "interaction_fwd", "top_mlp_fwd", "loss",
        "embedding_bwd", "mlp_bwd", "interaction_bwd", "optimizer",
    ):  # fmt: skip
        assert phase in phases, phase
    assert profile["step_ms"] == pytest.approx(sum(phases.values()), abs=0.01)
    assert profile["top_ops_ms"]
    wall = profile["wall_phases_ms"]  # the same steps by the wall clock, without the profiler
    assert tuple(wall) == WALL_PHASES
    assert all(ms >= 0 for ms in wall.values()), wall
    assert wall["embedding_fwd"] > 0 and wall["top_mlp_bwd"] > 0 and wall["embedding_bwd"] > 0
    assert profile["wall_step_ms"] == pytest.approx(sum(wall.values()), abs=0.01)


def test_wall_phases_follow_the_gradients_through_the_step(one_thread):
    """Each backward phase ends where its gradient arrives: a top MLP made slow shows up
    in top_mlp_bwd alone, a lookup made slow in embedding_bwd alone."""
    model, optimizer = _towerrec_row(SHAPE, "torch")
    batches = make_batches(SHAPE, 16, count=2)
    slow = 0.2  # far above any phase of this small model

    def sleeping(grad):
        time.sleep(slow)
        return grad

    top_weight = model.top[0].weight
    handle = top_weight.register_hook(sleeping)
    wall = wall_phase_table(model, optimizer, batches, 2)
    handle.remove()
    assert wall["top_mlp_bwd"] >= slow * 1e3
    assert all(wall[p] < slow * 1e3 for p in ("interaction_bwd", "bottom_mlp_bwd", "embedding_bwd"))
    kernel = model.sparse._kernels[0]
    apply = kernel.apply_gradient

    def slow_apply(*args, **kwargs):
        time.sleep(slow)
        return apply(*args, **kwargs)

    kernel.apply_gradient = slow_apply
    wall = wall_phase_table(model, optimizer, batches, 2)
    del kernel.apply_gradient
    assert wall["embedding_bwd"] >= slow * 1e3
    assert all(wall[p] < slow * 1e3 for p in ("top_mlp_bwd", "interaction_bwd", "bottom_mlp_bwd"))


@pytest.mark.parametrize(
    "node, phase",
    [
        ("AddmmBackward0", "mlp_bwd"),
        ("ReluBackward0", "mlp_bwd"),
        ("_PairwiseDotsBackward", "interaction_bwd"),
        ("_FusedLookupBackward", "embedding_bwd"),
        ("torch::autograd::CppNode<SplitLookupFunction_rowwise_adagrad_Op>", "embedding_bwd"),
        ("CatBackward0", "copies_bwd"),
        ("BinaryCrossEntropyWithLogitsBackward0", "loss_bwd"),
        ("torch::autograd::AccumulateGrad", "grad_accumulate"),
        ("SomethingNewBackward0", "backward_other"),
    ],
)
def test_backward_nodes_fall_in_their_phase(node, phase):
    assert backward_phase(node) == phase


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precisions", "fp8"], "--precisions fp8 unknown; choose from fp32, bf16"),
        (["--profile", "-1"], "--profile must be >= 0 steps, got -1"),
    ],
)
def test_bench_train_refuses_unknown_precisions_and_negative_profiles(argv, message):
    parser = argparse.ArgumentParser()
    BENCHMARK.add_arguments(parser)
    with pytest.raises(ValueError, match=re.escape(message)):
        BENCHMARK.run(parser.parse_args(["--no-torchrec", "--steps", "1", *argv]))


@needs_fbgemm
def test_the_default_row_runs_the_kernel_auto_measured(monkeypatch, tmp_path):
    import towerrec.build.choices as choices

    monkeypatch.setenv("TOWERREC_MEASURE", "1")
    monkeypatch.setenv("TOWERREC_CACHE_DIR", str(tmp_path))
    seconds = {"torch": 1.0, "fbgemm": 3.0}  # injected: torch "measured" faster
    monkeypatch.setattr(
        choices,
        "time_backend_steps",
        lambda workload, backends, **_: {b: seconds[b.value] for b in backends},
    )
    # injected: fp32 clearly faster, so auto keeps it (where the CPU has bf16 units)
    monkeypatch.setattr(choices, "time_precisions", lambda *a, **k: {"fp32": 0.5, "bf16": 1.0})
    picked = default_choices(SHAPE, 16)
    assert picked["backend"].value == "torch" and picked["backend"].how == "measured"
    assert picked["backend"].seconds == seconds
    assert picked["precision"].value == "fp32" and picked["precision"].how in ("measured", "only")
