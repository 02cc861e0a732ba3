"""The GPU benchmarks' code, run here on the CPU (tests/test_cuda.py runs it on a GPU):
the plain PyTorch peer computes towerrec's DLRM, the roofline and link bound are the
stated arithmetic, and the DMT compute benchmark reads and checks its shapes."""

import argparse
import json

import pytest
import torch

from towerrec.bench.device_limits import DeviceLimits, measure_limits
from towerrec.bench.device_train import run_device_train_benchmark, step_roofline
from towerrec.bench.dmt_compute import check_shape, load_shapes, measure_shape, run_dmt_compute
from towerrec.bench.plain_dlrm import plain_dlrm
from towerrec.bench.tiers import add_arguments, link_bounds, run_tiers_benchmark
from towerrec.bench.train import build_tables, make_batches, table_rows
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection

SHAPE = {
    "num_dense": 5,
    "num_tables": 4,
    "num_embeddings": 50,
    "embedding_dim": 8,
    "bottom_mlp": [16, 8],
    "top_mlp": [16, 1],
}


def small_train(device="cpu"):
    return run_device_train_benchmark(
        device,
        SHAPE,
        build_tables(SHAPE),
        make_batches(SHAPE, 64, count=2),
        steps=4,
        warmup=1,
        rounds=2,
        backends="torch",
        limits=measure_limits(torch.device(device), copy_bytes=1 << 20, matmul_n=64, repeats=3),
    )


def small_tiers(tmp_path, device="cpu", *extra):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--gib", "0.02", "--dim", "8", "--batch-size", "256", "--min-rows", "50000",
         "--cache-fraction", "0.005", "--steps", "3", "--warmup", "3", "--threads", "1",
         "--variants", "device,host", "--path", str(tmp_path), "--device", device, *extra]
    )  # fmt: skip
    return run_tiers_benchmark(args)


def tiny_shapes():
    return [
        {
            "name": "tiny",
            "batch_per_rank": 16,
            "num_features": 6,
            "embedding_dim": 4,
            "hosts": 3,
            "bottom_mlp": [8, 4],
            "top_mlp": [8, 1],
            "tower_outputs": 1,
        }
    ]


# tables of different sizes, one of them several ids a sample (as the planted shape's)
UNEVEN_SHAPE = {**SHAPE, "num_embeddings": [30, 50, 70, 40], "pooling_factors": [1, 2.5, 1, 3]}


@torch.no_grad()
def assert_peer_equals_towerrec(device, shape=SHAPE):
    """Both plain models, given towerrec's DLRM's weights, give its logits."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(build_tables(shape), backend="torch", device=device)
    model = DLRM(ebc, shape["num_dense"], shape["bottom_mlp"], shape["top_mlp"]).to(device)
    batch = make_batches(shape, 32, count=1)[0].to(device)
    expected = model(batch.dense, batch.sparse)
    mine = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = ebc.table_weights()
    rows = table_rows(shape)
    for fused in (True, False):
        peer, _ = plain_dlrm(shape, device, fused, 0.1, 0.1)
        theirs = [m for m in peer.modules() if isinstance(m, torch.nn.Linear)]
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            b.weight.copy_(a.weight[:, : b.in_features])  # towerrec may pad the top's input
            b.bias.copy_(a.bias)
        for t in range(shape["num_tables"]):
            if fused:
                start = sum(rows[:t])
                peer.tables[0].weight[start : start + rows[t]] = weights[f"t{t}"]
            else:
                peer.tables[t].weight.copy_(weights[f"t{t}"])
        sparse = batch.sparse
        got = peer(batch.dense, sparse.values(), sparse.lengths(), sparse.length_per_key())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [SHAPE, UNEVEN_SHAPE], ids=["even", "uneven"])
def test_plain_peer_computes_towerrecs_dlrm(shape):
    assert_peer_equals_towerrec(torch.device("cpu"), shape)


def test_device_train_benchmark_reports_ratios_and_roofline_fractions():
    out = small_train()
    assert set(out["precisions"]) == {"fp32", "bf16"}
    for row in out["precisions"].values():
        results, ref = row["results"], row["plain_reference"]
        assert set(results) == {"towerrec_torch", "plain_fused", "plain_per_table"}
        assert results[ref]["samples_per_s"] == max(
            results[n]["samples_per_s"] for n in ("plain_fused", "plain_per_table")
        )
        ratio = results["towerrec_torch"]["samples_per_s"] / results[ref]["samples_per_s"]
        assert row["ratios"][f"towerrec_torch/{ref}"] == pytest.approx(ratio, abs=1e-3)
        for r in results.values():
            frac = row["roofline"]["step_ms"] / r["step_ms"]
            assert r["roofline_fraction"] == pytest.approx(frac, rel=1e-3, abs=1e-4)
        parts = row["roofline"]["parts_ms"]
        assert row["roofline"]["step_ms"] == pytest.approx(sum(parts.values()), abs=1e-3)


def test_step_roofline_is_bytes_over_bandwidth_plus_flops_over_peak():
    limits = DeviceLimits("x", 1e9, {"float32": 1e9, "bfloat16": 4e9}, 1e9, 1e9, 0, 0, "highest")
    batches = make_batches(SHAPE, 10, count=1)
    values = batches[0].sparse.values().view(SHAPE["num_tables"], 10)
    distinct = sum(torch.unique(v).numel() for v in values)
    d, ids, bags = 8, 40, 40  # one id a bag, 4 tables x 10 samples
    emb_bytes = 4 * (ids * d + 2 * bags * d + distinct * 2 * (d + 1))
    got = step_roofline(SHAPE, batches, 1000, 100, limits, torch.bfloat16)
    assert got["embedding_bytes"] == emb_bytes and got["distinct_rows"] == distinct
    assert got["parts_ms"]["dense_ms"] == pytest.approx(1000 * 10 / 4e9 * 1e3)
    assert got["parts_ms"]["optimizer_ms"] == pytest.approx(32 * 100 / 1e9 * 1e3)
    assert got["step_ms"] == pytest.approx(sum(got["parts_ms"].values()), abs=1e-4)


def test_a_link_bound_adds_the_missed_bytes_over_the_link():
    args = argparse.Namespace(batch_size=100, steps=4)
    results = {
        "device": {"samples_per_s": 1000.0},  # 0.1 s a step
        "host": {"samples_per_s": 500.0, "missed_bytes": 4e8, "bytes_written": 8.0},
    }
    ratios = link_bounds(args, results, {"h2d_bytes_per_s": 1e9})
    # 1e8 bytes a step over 1e9 B/s: 0.1 s + 0.1 s, 500 samples/s at the bound
    assert results["host"]["link_bound_samples_per_s"] == 500.0
    assert ratios == {"host/link_bound": 1.0}
    assert results["host"]["missed_bytes_per_step"] == 1e8


def test_tiers_report_the_link_bound_and_missed_bytes(tmp_path):
    out = small_tiers(tmp_path, "cpu", "--cache-maps", "device")
    host = out["results"]["host"]
    assert out["cache_maps"] == "device" and out["link"]["h2d_bytes_per_s"] > 0
    assert host["missed_bytes"] == host["rows_read"] * 4 * (8 + 1)  # weight and momentum
    assert out["ratios"]["host/link_bound"] > 0
    assert host["link_bound_samples_per_s"] <= out["results"]["device"]["samples_per_s"]


def test_dmt_compute_shapes_are_checked(tmp_path):
    (shape,) = tiny_shapes()
    assert check_shape(shape)["tower"] == "dot"
    for bad, match in [
        ({k: v for k, v in shape.items() if k != "hosts"}, "missing hosts"),
        ({**shape, "towers": 2}, "unknown keys towers"),
        ({**shape, "hosts": 4}, "must split evenly into hosts 4"),
        ({**shape, "bottom_mlp": [8, 5]}, "bottom_mlp must end at embedding_dim 4"),
        ({**shape, "top_mlp": [8, 2]}, "top_mlp must end at 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_shape(bad)
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"shapes": [shape]}))
    assert load_shapes(path)[0]["name"] == "tiny"
    path.write_text(json.dumps({"shape": shape}))
    with pytest.raises(ValueError, match="give a JSON list of shape objects"):
        load_shapes(path)
    with pytest.raises(ValueError, match="cannot read a JSON list"):
        load_shapes(tmp_path / "missing.json")


def test_dmt_compute_counts_the_towers_work_per_rank():
    shape = check_shape(tiny_shapes()[0])
    row = measure_shape(shape, torch.device("cpu"), None, repeats=2)
    work, parts = row["workload"], row["parts"]
    # one rank runs its tower on H x B samples of T / H features
    assert parts["tower"]["flops"] == work["tower_flops_per_sample"] * shape["batch_per_rank"]
    assert work["compression"] == 2.0  # 2 features a tower to 1 output
    assert parts["flat_dense"]["flops"] == work["dense_flops_per_sample"] * 16
    out = run_dmt_compute(tiny_shapes(), "cpu", ("fp32",), repeats=2)
    assert out["shapes"][0]["fp32"]["measured"]["flat_step_compute_s"] > 0
