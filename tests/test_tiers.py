"""Tier-aware planning on small synthetic profiles, ``towerrec plan --profile``, and the
storage calibration."""

import itertools
import json
import tomllib

import numpy as np
import pytest

from towerrec.calibration.storage import measure_storage
from towerrec.cli import main
from towerrec.data.locality import summarize
from towerrec.data.profile import LocalityProfile
from towerrec.planner.tier_spec import TierSpec
from towerrec.planner.tiers import TieringError, hosts_needed, plan_tiers
from towerrec.planner.topology import GiB

MiB = 1 << 20
ROW = 256  # bytes per row: dim 64 in fp32, no optimizer state


def zipf_table(name, rows, alpha=1.05, n=30_000, batch=512, seed=0):
    """A table profiled from a Zipf stream over ``rows`` permuted ids."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(rows)[(rng.zipf(alpha, n) - 1) % rows]
    per_batch = [len(np.unique(ids[i : i + batch])) for i in range(0, n, batch)]
    return summarize(
        name,
        rows,
        ids,
        batch_size=batch,
        pooling_factor=1.0,
        distinct_per_batch=np.array(per_batch, dtype=np.float64),
        total_lookups=n,
    )


@pytest.fixture(scope="module")
def tables():
    sizes = (200_000, 100_000, 50_000, 20_000)
    return [zipf_table(f"t{i}", rows, seed=i) for i, rows in enumerate(sizes)]


def spec(device, host, ssd):
    return TierSpec(
        device_memory=device,
        host_memory=host,
        ssd_capacity=ssd,
        host_bandwidth=10e9,
        ssd_read_bandwidth=2e9,
        ssd_write_bandwidth=1e9,
        ssd_read_latency_s=80e-6,
        ssd_io_depth=8,
    )


def model_bytes(tables):
    return sum(t.num_embeddings * ROW for t in tables)


def test_a_model_that_fits_in_device_memory_stays_on_the_device(tables):
    rows = {t.name: ROW for t in tables}
    plan = plan_tiers(tables, rows, spec(model_bytes(tables), 0, 0), 512)
    assert all(t.memory == "device" and t.cache_fraction == 1.0 for t in plan.tables)
    assert plan.step_seconds == 0.0
    snippet = tomllib.loads(plan.to_toml())
    assert snippet["embedding"]["tables"]["t0"] == {"memory": "device"}


def test_a_model_4x_host_memory_goes_to_ssd_with_the_curves_cache_fraction(tables):
    rows = {t.name: ROW for t in tables}
    total = model_bytes(tables)
    tiers = spec(device=total / 20, host=total / 4, ssd=10 * total)
    plan = plan_tiers(tables, rows, tiers, 512)
    assert plan.used("device") <= tiers.device_memory
    assert plan.used("host") <= tiers.host_memory
    assert plan.used("ssd") >= total / 2  # most of the model cannot sit in host memory
    by_name = {t.name: t for t in plan.tables}
    big = by_name["t0"]
    assert big.memory == "cached" and big.backing == "ssd"
    loc = tables[0]
    # The cache is a point of the profile's curve (or the batches' minimum), and the
    # predicted hit rate and misses are the curve's there.
    points = {r for r, _ in loc.curve} | {int(np.ceil(2 * loc.distinct_per_batch["p99"]))}
    assert big.cache_rows in points and 0 < big.cache_fraction < 1
    assert big.hit_rate == pytest.approx(loc.hit_rate(big.cache_rows), abs=1e-12)
    assert big.misses_per_step == pytest.approx(512 * (1 - big.hit_rate))
    snippet = tomllib.loads(plan.to_toml("/mnt/ssd/x"))["embedding"]["tables"]["t0"]
    assert snippet["memory"] == "cached" and snippet["backing"] == "ssd"
    assert snippet["backing_path"] == "/mnt/ssd/x" and snippet["cache_policy"] == "lru"
    assert big.cache_fraction <= snippet["cache_fraction"] < big.cache_fraction + 1e-3
    # Without an SSD tier the same model does not fit, and says what to give.
    with pytest.raises(TieringError, match="give an SSD tier"):
        plan_tiers(tables, rows, spec(total / 20, total / 4, 0), 512)


def test_more_device_memory_never_predicts_a_slower_step(tables):
    rows = {t.name: ROW for t in tables}
    total = model_bytes(tables)
    times = [
        plan_tiers(tables, rows, spec(total * share, total / 4, 10 * total), 512).step_seconds
        for share in (0.02, 0.05, 0.1, 0.3, 0.6, 0.9)
    ]
    assert all(a >= b for a, b in itertools.pairwise(times)) and times[0] > times[-1]


def test_the_host_count_with_ssd_is_smaller(tables):
    rows = {t.name: ROW for t in tables}
    total = model_bytes(tables)
    per_host = spec(device=total / 40, host=total / 16, ssd=total)
    needed = hosts_needed(tables, rows, per_host, 512, step_budget_s=1.0)
    without, with_ssd = needed["without_ssd"], needed["with_ssd"]
    assert with_ssd["capacity"] == 1 and with_ssd["hosts"] < without["hosts"]
    assert without["capacity"] >= 11  # (1/40 + 1/16) of the model per host: ceil(11.4)
    tight = hosts_needed(tables, rows, per_host, 512, step_budget_s=1e-5)
    assert tight["with_ssd"]["hosts"] > with_ssd["hosts"]  # bandwidth now binds
    assert with_ssd["bound"] == "capacity" and tight["with_ssd"]["bound"] == "bandwidth"


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory, tables):
    path = tmp_path_factory.mktemp("tiers") / "profile.json"
    LocalityProfile("zipf", 512, 30_000, 30_000, 4_000_000, tuple(tables)).save(path)
    return path


def test_plan_cli_warns_of_options_it_ignores(profile_file, tmp_path, capsys, caplog):
    out = ["--world-size", "1", "--json", "--out", str(tmp_path / "plan.json")]
    assert main(["plan", *out, "--host-memory", "8"]) == 0  # a sharding plan
    assert "--host-memory only apply to tier planning: add --profile" in caplog.text
    assert "max_cost_ms" in json.loads(capsys.readouterr().out)
    caplog.clear()
    assert main(["plan", "--profile", str(profile_file), *out, "--suite", "4"]) == 0
    assert "ignoring --suite" in caplog.text
    assert json.loads(capsys.readouterr().out)["tables"][0]["name"] == "t0"


def test_plan_cli_writes_the_config_keys(profile_file, tmp_path, capsys):
    snippet = tmp_path / "tiers.toml"
    args = ["plan", "--profile", str(profile_file), "--world-size", "1", "--json"]
    sizes = ["--device-memory", "0.005", "--host-memory", "0.02", "--ssd-capacity", "1"]
    assert main([*args, *sizes, "--write-config", str(snippet), "--set",
                 "embedding.optimizer=sgd"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert {t["memory"] for t in out["tables"]} >= {"cached"}
    assert out["used_bytes"]["device"] <= 0.005 * GiB
    assert out["hosts_needed"]["with_ssd"]["capacity"] == 1
    # model.embedding_dim 16 in fp32 with SGD: 64 bytes a row.
    assert out["tables"][0]["row_bytes"] == 64
    keys = tomllib.loads(snippet.read_text())["embedding"]["tables"]
    assert set(keys) == {"t0", "t1", "t2", "t3"}
    # Row-wise Adagrad (the default) adds its 4-byte state to every row.
    assert main([*args, *sizes]) == 0
    assert json.loads(capsys.readouterr().out)["tables"][0]["row_bytes"] == 68
    assert main([*args[:-1], "--device-memory", "0.00001"]) == 2
    assert "cannot hold even the caches' minimum" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "none.json")]) == 2
    assert "towerrec data profile" in capsys.readouterr().err


def test_storage_calibration_measures_the_folder(tmp_path):
    measured = measure_storage(tmp_path, size_mib=4, reads=20)
    for key in ("ssd_write_bandwidth", "ssd_read_bandwidth", "ssd_read_latency_s",
                "host_copy_bandwidth"):  # fmt: skip
        assert measured[key] > 0, key
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone
    with pytest.raises(FileNotFoundError, match="--ssd-path"):
        measure_storage(tmp_path / "missing")


def test_tier_spec_reads_the_calibrations_storage_speeds():
    from towerrec.planner.tier_spec import tier_spec_for
    from towerrec.planner.topology import topology_preset

    storage = {"path": "/ssd", "ssd_read_bandwidth": 1e9, "ssd_write_bandwidth": 5e8,
               "ssd_read_latency_s": 5e-5, "host_copy_bandwidth": 3e10}  # fmt: skip
    cpu = tier_spec_for(topology_preset("cpu", 1, 2), storage)
    assert (cpu.ssd_read_bandwidth, cpu.ssd_write_bandwidth) == (1e9, 5e8)
    assert cpu.ssd_read_latency_s == 5e-5 and cpu.host_bandwidth == 3e10
    assert cpu.device_memory == 2 * 4 * GiB and cpu.source == "measured (/ssd)"
    gpu = tier_spec_for(topology_preset("gpu", 1, 8), storage)
    assert gpu.host_bandwidth == 8 * 25e9  # PCIe per GPU, not the host's memory copy
    assert gpu.ssd_miss_seconds(64) == pytest.approx(5e-5 / 32 + 4096 / 1e9 + 64 / 5e8)
