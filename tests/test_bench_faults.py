"""``towerrec bench faults`` and ``towerrec bench soak``: the probe reaches the library's
functions it wraps and fires its fault at the step asked for, the recovery figures
are read correctly off the progress records, and a small fault matrix on 2 ranks
ends equal to its reference."""

import importlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from towerrec.bench.fault_cases import FaultSettings
from towerrec.bench.fault_runs import checkout_env, recovery
from towerrec.bench.probe import PATCH_POINTS, ProbeSpec, write_sitecustomize
from towerrec.bench.soak import growth

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("module", sorted(PATCH_POINTS))
def test_the_functions_the_probe_wraps_exist(module):
    """A rename in the library would silently turn the probe (and every fault) off."""
    loaded = importlib.import_module(module)
    for dotted in PATCH_POINTS[module]:
        target = loaded
        for part in dotted.split("."):
            target = getattr(target, part)
        assert callable(target), dotted


def _progress(*records):
    return [{"time": t, "step": s, "restart": r} for t, s, r in records]


def test_recovery_after_a_restart():
    progress = _progress((1, 10, 0), (2, 11, 0), (3, 12, 0), (9, 11, 1), (10, 12, 1), (11, 13, 1))
    got = recovery(progress, fault_time=2.5)
    assert got == {
        "fault_step": 12,  # the failed attempt's last step, even if it came after the fault
        "restarts": 1,
        "resumed_from": 10,
        "steps_redone": 2,
        "restart_s": 6.5,
        "recovery_s": 8.5,
    }


def test_recovery_without_a_restart_is_a_stall():
    progress = _progress((1, 10, 0), (2, 11, 0), (40, 12, 0))
    assert recovery(progress, fault_time=2.5) == {
        "fault_step": 11, "restarts": 0, "steps_redone": 0, "stall_s": 37.5,
    }  # fmt: skip
    assert recovery(progress, fault_time=0.5) == {"fault_step": None}


def test_fault_settings_refuse_a_run_too_short_for_its_faults():
    with pytest.raises(ValueError, match="at least 4 x --checkpoint-every"):
        FaultSettings(steps=30, checkpoint_every=10)
    with pytest.raises(ValueError, match="multiple of --hosts"):
        FaultSettings(nproc=3, hosts=2)


def test_growth_fits_a_line():
    flat = growth([500, 1000, 1500, 2000], [100.0, 101.0, 99.0, 100.0])
    assert abs(flat["growth_pct"]) < 1.5
    rising = growth([0, 1000, 2000], [100.0, 105.0, 110.0])
    assert rising == {"slope_per_1k_steps": 5.0, "growth_pct": 10.0}


def test_the_probe_kills_one_process_at_its_step_and_records_progress(tmp_path):
    site = tmp_path / "site"
    write_sitecustomize(site)
    spec = ProbeSpec(str(tmp_path), fault="kill", rank=0, step=4, sample_every=2)
    command = [
        sys.executable, "-m", "towerrec.cli", "train", "--config",
        str(ROOT / "configs" / "quick.toml"), "--out", str(tmp_path / "run"),
        "--set", "train.steps=8", "--set", "train.progress=false",
        "--set", "train.eval_every=0", "--set", "data.synthetic.eval_samples=1024",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=checkout_env(site, spec.environ()), capture_output=True, timeout=300
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "progress.jsonl").open()]
    assert steps == [1, 2, 3, 4]
    assert json.loads((tmp_path / "fault.json").read_text())["step"] == 4
    samples = [json.loads(line) for line in (tmp_path / "samples_rank0.jsonl").open()]
    assert [s["step"] for s in samples] == [2, 4]
    assert all(s["rss_mb"] > 10 and s["fds"] > 0 and s["threads"] >= 1 for s in samples)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_small_fault_matrix_ends_equal_to_its_reference(tmp_path):
    from towerrec.bench.faults import run_faults

    settings = FaultSettings(
        steps=12, batch_size=64, checkpoint_every=3, eval_every=6, nproc=2, hosts=1,
        max_restarts=1, timeout_s=600,
    )  # fmt: skip
    result = run_faults(
        settings, ("kill_checkpoint", "kill_eval"), tmp_path / "work", files=1, rows=3000,
        num_embeddings=200,
    )  # fmt: skip
    for name, row in result["cases"].items():
        assert row["ok"] and row["fired"] and row["equal"], (name, row)
        assert row["restarts"] == 1 and row["resumed_from"] % 3 == 0, (name, row)
