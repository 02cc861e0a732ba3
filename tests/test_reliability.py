"""What the fault benchmark found, fixed and kept fixed: groups that wait as long as
distributed.timeout_s says, loader workers that end on SIGTERM, a checkpoint that
cannot be written for want of space named as such with the previous one intact,
and torchrun's restarts resuming the run."""

import errno
import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_cli
from torch import nn

from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.distributed.launch import spawn_world
from towerrec.train import checkpoint as checkpoint_module
from towerrec.train.checkpoint import CheckpointManager


@pytest.fixture(scope="module")
def criteo_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("criteo-reliability")
    days = generate_criteo_files(root / "raw", files=1, rows_per_file=400, seed=1)
    preprocess_criteo(days, root / "cache", CriteoOptions(num_embeddings=(50,)), progress=False)
    return root / "cache"


def _group_timeouts(topology):
    from towerrec.distributed.mesh import new_group

    group = new_group(list(range(topology.world_size)))
    own = group._get_backend(torch.device("cpu")).options._timeout
    plain = dist.new_group(list(range(topology.world_size)))
    return own, plain._get_backend(torch.device("cpu")).options._timeout


@pytest.mark.multiprocess
def test_the_groups_towerrec_makes_wait_as_long_as_the_world_does():
    """torch gives a new gloo group 30 minutes; ours take the world's timeout."""
    own, plain = spawn_world(_group_timeouts, 2, 1, timeout_s=17.0)[0]
    assert own == timedelta(seconds=17)
    assert plain != own  # what the plain call gives: the reason for the wrapper


def _serve_batches(cache, ready, done):
    from towerrec.data.cache import open_cache
    from towerrec.data.loader import ColumnSource, LoaderConfig

    signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer's handler: keep running
    source = ColumnSource(open_cache(cache), LoaderConfig(num_workers=1, prefetch=1))
    batches = source.train_batches(8, 0, 0, 1)
    next(batches)
    ready.set()
    done.wait(60)


@pytest.mark.multiprocess
def test_a_loader_worker_ends_on_sigterm_whatever_its_trainer_does(criteo_cache):
    context = multiprocessing.get_context("fork")
    ready, done = context.Event(), context.Event()
    trainer = context.Process(target=_serve_batches, args=(criteo_cache, ready, done))
    trainer.start()
    try:
        assert ready.wait(60)
        children = Path(f"/proc/{trainer.pid}/task/{trainer.pid}/children").read_text()
        workers = [int(c) for c in children.split()]
        assert workers
        os.kill(workers[0], signal.SIGTERM)
        for _ in range(100):  # ended: gone, or a zombie its parent has not reaped yet
            if _ended(workers[0]):
                break
            time.sleep(0.1)
        assert _ended(workers[0])
    finally:
        done.set()
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()


def _ended(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_checkpoint_without_room_is_refused_naming_the_disk_and_the_intact_one(
    tmp_path, monkeypatch
):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    manager = CheckpointManager(tmp_path / "checkpoint")
    train = {"step": 1, "samples": 0, "train_s": 0.0, "rng": {}}
    manager.save(1, model, optimizer, train)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.dcp, "save", full)
    with pytest.raises(ValueError, match=r"step_00000002 .*the disk is full.*step_00000001"):
        manager.save(2, model, optimizer, train)
    assert manager.steps() == [1]
    assert not list((tmp_path / "checkpoint").glob("*.partial"))  # its space is given back


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_restarts_resume_the_run(tmp_path):
    """A rank killed under ``torchrun --max-restarts``: the restarted workers resume from
    the last checkpoint instead of refusing the run directory as taken."""
    from towerrec.bench.fault_runs import checkout_env
    from towerrec.bench.probe import ProbeSpec, write_sitecustomize

    write_sitecustomize(tmp_path / "site")
    spec = ProbeSpec(str(tmp_path), fault="kill", rank=1, step=5)
    quick = str(run_cli.__globals__["ROOT"] / "configs" / "quick.toml")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=1", "-m", "towerrec.cli", "train", "--config", quick, "--out",
        str(tmp_path / "run"), "--set", "train.steps=8", "--set", "train.checkpoint_every=2",
        "--set", "train.eval_every=0", "--set", "train.progress=false",
        "--set", "data.synthetic.eval_samples=1024",
    ]  # fmt: skip
    import subprocess

    done = subprocess.run(
        command,
        env=checkout_env(tmp_path / "site", spec.environ()),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "fault.json").exists()  # the rank was killed
    assert "resuming from the last checkpoint" in done.stderr
    assert '"completed": true' in (tmp_path / "run" / "summary.json").read_text()


def test_a_run_stopped_before_its_first_evaluation_says_so(tmp_path, capsys, one_thread):
    """A SIGTERM before the first evaluation leaves a summary without metrics: the
    command says how to continue instead of failing on the missing AUC."""
    from test_trainer import quick_config

    from towerrec.cli.train import _print_summary
    from towerrec.workflows.training import train

    config = quick_config("train.steps=8", "train.eval_every=6", "embedding.backend=torch")
    summary = train(config, tmp_path / "run", stop_after=3)
    assert not summary["completed"] and "auc" not in summary
    _print_summary(summary, tmp_path / "run")
    printed = capsys.readouterr().out
    assert "stopped after step 3, before the first evaluation" in printed
    assert f"towerrec train --out {tmp_path / 'run'} --resume" in printed
