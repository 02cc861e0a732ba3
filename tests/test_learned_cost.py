"""The learned device cost model on a known non-additive cost, and its benchmark plumbing."""

import json
import struct
import zipfile

import numpy as np
import pytest
import torch

from towerrec.calibration import random_device
from towerrec.planner.learned_cost import LearnedCostModel


def _fused_cost(shards, batch=2048):
    """A made-up fused-kernel time: per width one launch, and a width's lookups
    run at a speed that grows with how many tables share it (not additive)."""
    by_width = {}
    for stats, rows, cols in shards:
        ids = stats.lookups(batch) * rows / stats.num_embeddings
        by_width.setdefault(cols, []).append(ids * (1 + cols / 32) * 1e-8)
    return sum(5e-4 + sum(w) / len(w) ** 0.5 for w in by_width.values())


def test_learned_model_fits_held_out_devices_of_a_fused_cost(tmp_path, one_thread):
    rng = np.random.default_rng(0)
    devices = [random_device(rng, f"d{i}") for i in range(240)]
    seconds = [_fused_cost(d) for d in devices]
    model = LearnedCostModel(batch=2048)
    model.fit(devices[:180], seconds[:180], steps=800)
    predicted = np.array(model.predict(devices[180:]))
    truth = np.array(seconds[180:])
    rel = np.abs(predicted - truth) / truth
    assert np.median(rel) < 0.15
    # Additive per-table sums (the analytic form) miss the sharing.
    alone = np.array([sum(_fused_cost([s]) for s in d) for d in devices[180:]])
    assert np.median(np.abs(alone - truth) / truth) > 2 * np.median(rel)
    model.save(tmp_path / "m.pt")
    again = LearnedCostModel.load(tmp_path / "m.pt")
    assert again.predict(devices[180:183]) == pytest.approx(predicted[:3].tolist())


def _tensors(value, name=""):
    """(key path, tensor) of every tensor in a loaded weights file's dicts."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}/{key}")


def flip_tensor_byte(path):
    """Flip one bit in the middle of the first tensor's bytes (the torch zip's entry
    ``data/0``, stored uncompressed); checks that torch.load still reads the file and
    that a tensor it returns changed, so the damage reached the weights."""
    before = dict(_tensors(torch.load(path, weights_only=True)))
    with zipfile.ZipFile(path) as archive:
        (entry,) = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
    assert entry.compress_type == zipfile.ZIP_STORED and entry.file_size > 0
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", raw, entry.header_offset + 26)
    start = entry.header_offset + 30 + name_len + extra_len  # after the local header
    raw[start + entry.file_size // 2] ^= 0x01
    path.write_bytes(raw)
    after = dict(_tensors(torch.load(path, weights_only=True)))  # no CRC check in torch
    assert [k for k in before if not torch.equal(before[k], after[k])], "no tensor changed"


def test_a_damaged_weights_file_is_refused(tmp_path):
    model = LearnedCostModel(hidden=8, batch=2048)
    model.save(tmp_path / "m.pt")
    LearnedCostModel.load(tmp_path / "m.pt")  # the undamaged file loads
    flip_tensor_byte(tmp_path / "m.pt")
    with pytest.raises(ValueError, match=r"m\.pt' does not match its own weights_sha256.*fit"):
        LearnedCostModel.load(tmp_path / "m.pt")


def test_learned_model_rejects_bad_training_data():
    model = LearnedCostModel()
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="one measured time per device"):
        model.fit([random_device(rng, "x")], [1.0, 2.0])
    with pytest.raises(ValueError, match="must be > 0"):
        model.fit([random_device(rng, "x")], [0.0])


def test_costmodel_benchmark_from_saved_samples(tmp_path, one_thread):
    from towerrec.bench.costmodel import _to_json, run_costmodel_benchmark

    rng = np.random.default_rng(2)
    devices = [random_device(rng, f"d{i}") for i in range(40)]
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(_to_json(devices, [_fused_cost(d) for d in devices])))
    result = run_costmodel_benchmark(samples_in=str(path))
    assert result["devices"] == {"train": 30, "held_out": 10, "batch": 2048}
    # Both fit the made-up cost within 30% (measured: about 3% and 10%); a model that
    # has not been trained is off by orders of magnitude, so the bound can fail.
    for key in ("analytic_calibrated", "learned"):
        assert 0 <= result[key]["median_rel_error"] < 0.3, result[key]
    untrained = np.array(LearnedCostModel(batch=2048).predict(devices))
    truth = np.array([_fused_cost(d) for d in devices])
    assert np.median(np.abs(untrained - truth) / truth) > 0.3
