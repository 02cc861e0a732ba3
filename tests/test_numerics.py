"""A run's numbers depend on its config, its seed and its thread count only, never on
what ran before it in the process (train/numerics.py)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import run_cli
from test_trainer import QUICK, final_state, quick_config

from towerrec.bench.common import keeps_process_settings
from towerrec.train import loop
from towerrec.train.numerics import (
    available_cores,
    flush_subnormals,
    flushing_subnormals,
    pinned,
    resolve_threads,
)
from towerrec.workflows import training as trainer


def test_threads_resolve_from_the_config_then_the_declared_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert available_cores() == 3
    assert resolve_threads(0) == 3
    assert resolve_threads(0, local_ranks=2) == 1
    assert resolve_threads(0, local_ranks=8) == 1  # never fewer than one
    assert resolve_threads(5, local_ranks=2) == 5  # train.threads wins
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset or empty: the CPU affinity
    assert available_cores() == len(os.sched_getaffinity(0))


def _recording_threads(monkeypatch) -> list[int]:
    """The intra-op thread count at each training step of ``trainer.train``."""
    seen: list[int] = []
    step = loop.train_step

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", recording)
    return seen


def test_a_run_sets_its_own_threads_and_gives_the_process_its_settings_back(tmp_path, monkeypatch):
    """Trained twice, once from the process's own settings and once after something set
    one thread and bf16 matmuls process-wide (as an earlier test or a user's notebook
    cell may): both runs step at the resolved count with IEEE matmuls, end with the same
    weights, and the process has its settings back after each."""
    config = quick_config("train.steps=8", "embedding.backend=torch")
    seen = _recording_threads(monkeypatch)
    trainer.train(config, tmp_path / "a")
    expected = resolve_threads(0)
    assert seen == [expected] * 8
    baseline = torch.get_num_threads(), torch.backends.mkldnn.matmul.fp32_precision

    other = 1 if expected > 1 else 2
    torch.set_num_threads(other)
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    seen.clear()
    precision: list[str] = []
    set_rates = loop.set_learning_rates

    def recording_precision(*args):
        precision.append(torch.backends.mkldnn.matmul.fp32_precision)
        return set_rates(*args)

    monkeypatch.setattr(loop, "set_learning_rates", recording_precision)
    try:
        summary = trainer.train(config, tmp_path / "b")
        assert (torch.get_num_threads(), torch.backends.mkldnn.matmul.fp32_precision) == (
            other,
            "bf16",
        )
    finally:
        torch.set_num_threads(baseline[0])
        torch.backends.mkldnn.matmul.fp32_precision = baseline[1]
    assert seen == [expected] * 8 and precision == ["ieee"] * 8
    assert summary["threads"] == expected
    a, b = final_state(tmp_path / "a", config), final_state(tmp_path / "b", config)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_resume_keeps_the_thread_count_its_checkpoint_records(tmp_path, monkeypatch):
    config = quick_config("train.steps=10", "embedding.backend=torch")
    one = quick_config("train.steps=10", "embedding.backend=torch", "train.threads=1")
    trainer.train(one, tmp_path / "full")
    trainer.train(one, tmp_path / "split", stop_after=4)
    seen = _recording_threads(monkeypatch)
    # the resumed run's config asks for the default count: the checkpoint's 1 wins
    summary = trainer.train(config, tmp_path / "split", resume=True)
    assert seen == [1] * 6 and summary["threads"] == 1
    a, b = final_state(tmp_path / "full", config), final_state(tmp_path / "split", config)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_pinned_restores_the_process_settings_on_error():
    before = torch.get_num_threads(), flushing_subnormals()
    with pytest.raises(RuntimeError, match="boom"), pinned():
        torch.set_num_threads(1 if before[0] > 1 else 2)
        assert flushing_subnormals()
        raise RuntimeError("boom")
    assert (torch.get_num_threads(), flushing_subnormals()) == before


def _subnormal_product(threads: int) -> torch.Tensor:
    """A matrix product whose every entry is subnormal in fp32 (about 6.4e-39), at
    ``threads`` intra-op threads (split among them at this size)."""
    a = torch.full((256, 64), 1e-20)
    b = torch.full((64, 256), 1e-21)
    torch.set_num_threads(threads)
    return a @ b


@pytest.mark.parametrize("threads", [1, 2])
def test_subnormals_are_flushed_in_a_run_and_kept_outside(threads):
    before = torch.get_num_threads()
    try:
        assert not flushing_subnormals()  # the process's own mode: IEEE subnormals
        assert (_subnormal_product(threads) > 0).all()
        with flush_subnormals():
            assert flushing_subnormals()
            assert (_subnormal_product(threads) == 0).all()  # on every thread of the product
        assert not flushing_subnormals()
        assert (_subnormal_product(threads) > 0).all()
    finally:
        torch.set_num_threads(before)


def test_a_run_and_a_benchmark_step_with_subnormals_flushed(tmp_path, monkeypatch):
    """``towerrec train``'s steps and a benchmark's run with subnormals flushed, and the
    process has its IEEE mode back after each."""
    config = quick_config("train.steps=3", "embedding.backend=torch")
    modes: list[bool] = []
    step = loop.train_step

    def recording(*args, **kwargs):
        modes.append(flushing_subnormals())
        return step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", recording)
    trainer.train(config, tmp_path / "run")
    assert modes == [True] * 3 and not flushing_subnormals()
    assert keeps_process_settings(flushing_subnormals)() and not flushing_subnormals()


def test_resume_through_the_cli_is_exact_on_a_loaded_machine(tmp_path):
    """Busy processes keep every core loaded while one run trains straight through in a
    `towerrec train` process and another stops in this process, then resumes in a new
    one: the same weights bit for bit (the thread count is the run's, not the load's)."""
    overrides = [*QUICK, "train.steps=12", "embedding.lr=0.2", "optimizer.lr=0.005"]
    config = quick_config(*overrides[len(QUICK) :])
    load = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(max(2, available_cores()))
    ]
    try:
        sets = [arg for o in overrides for arg in ("--set", o)]
        full = run_cli("train", "--out", str(tmp_path / "full"), *sets)
        assert full.returncode == 0, full.stderr[-2000:]
        trainer.train(config, tmp_path / "split", stop_after=6)
        resumed = run_cli("train", "--out", str(tmp_path / "split"), "--resume")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
    finally:
        for p in load:
            p.kill()
            p.wait()
    a, b = final_state(tmp_path / "full", config), final_state(tmp_path / "split", config)
    for key in a:
        assert torch.equal(a[key], b[key]), key
