"""A resume checks its checkpoint: a damaged latest is refused naming the file and
offering the previous intact checkpoint, which ``--resume-from step_N`` then resumes
from (never silently); the damaged one is set aside, not deleted, and the run ends
where an uninterrupted one ends."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from test_checkpoint_verify import flip, snapshot
from test_trainer import final_state, quick_config

from towerrec.checksums import CHECKSUMS
from towerrec.config import load_config
from towerrec.train.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from towerrec.workflows import training as trainer

SETTINGS = ("train.steps=8", "train.checkpoint_every=2", "embedding.backend=torch")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 8-step run (checkpoints of steps 6 and 8) and its final state."""
    run = tmp_path_factory.mktemp("finished") / "run"
    config = quick_config(*SETTINGS)
    trainer.train(config, run)
    return run, final_state(run, config)


@pytest.fixture
def run(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished[0], copy)
    return copy


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_checkpoint_of_a_run_carries_checksums(run):
    assert CheckpointManager(run / "checkpoint").steps() == [6, 8]
    for step in (6, 8):
        path = run / "checkpoint" / f"step_{step:08d}"
        assert (path / CHECKSUMS).is_file()
        verify_checkpoint(path)


def test_a_damaged_latest_is_refused_and_the_previous_one_resumed_from_when_asked(finished, run):
    config = quick_config(*SETTINGS)
    flip(run / "checkpoint" / "step_00000008" / "__0_0.distcp")
    before = snapshot(run)
    with pytest.raises(CheckpointError) as refused:
        trainer.train(config, run, resume=True)
    message = str(refused.value)
    assert "step_00000008 is damaged" in message and "__0_0.distcp does not match" in message
    assert "previous intact checkpoint is step 6" in message and "--resume-from step_6" in message
    assert "nothing was deleted" in message
    assert snapshot(run) == before  # the refusal changed nothing: files, metrics, summary

    resumed = trainer.train(config, run, resume_from=6)
    assert resumed["completed"] and resumed["steps"] == 8
    final = final_state(run, config)
    assert final.keys() == finished[1].keys()
    for key, value in finished[1].items():  # as the uninterrupted run ended, bit for bit
        assert torch.equal(final[key], value), key
    kept = run / "checkpoint" / "step_00000008.superseded"  # the damaged one, set aside
    assert snapshot(kept) == {
        k.removeprefix("checkpoint/step_00000008/"): v
        for k, v in before.items()
        if k.startswith("checkpoint/step_00000008/")
    }
    assert CheckpointManager(run / "checkpoint").steps() == [6, 8]
    assert [r for r in _records(run) if r["kind"] == "resume"] == [
        {"kind": "resume", "step": 6, "changed": {}}
    ]
    assert [r["step"] for r in _records(run) if r["kind"] == "train"] == [5, 8]


def test_with_no_intact_checkpoint_left_the_refusal_says_so(run):
    for step in (6, 8):
        flip(run / "checkpoint" / f"step_{step:08d}" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="No earlier intact checkpoint is left"):
        trainer.train(quick_config(*SETTINGS), run, resume=True)
    with pytest.raises(CheckpointError, match=r"step_00000006 is damaged.*No earlier intact"):
        trainer.train(quick_config(*SETTINGS), run, resume_from=6)


def test_resume_from_a_step_without_a_checkpoint_names_those_there(run):
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint of step 4; it holds steps \[6, 8\]"
    ):
        trainer.train(quick_config(*SETTINGS), run, resume_from=4)


def test_a_checkpoint_without_checksums_is_refused_unless_verification_is_off(finished, run):
    """As a checkpoint of a towerrec before checksums: refused with the fix named; with
    train.verify_checkpoints = false (resume-safe) the run resumes from it."""
    (run / "checkpoint" / "step_00000008" / CHECKSUMS).unlink()
    shutil.rmtree(run / "checkpoint" / "step_00000006")
    longer = ("train.steps=10",)
    with pytest.raises(CheckpointError, match=r"--set train\.verify_checkpoints=false"):
        trainer.train(quick_config(*SETTINGS, *longer), run, resume=True)
    unverified = quick_config(*SETTINGS, *longer, "train.verify_checkpoints=false")
    assert trainer.train(unverified, run, resume=True)["steps"] == 10
    records = [r for r in _records(run) if r["kind"] == "resume"]
    assert records[-1]["changed"]["train.verify_checkpoints"] == {"from": True, "to": False}


def test_the_command_line_refuses_then_resumes_from_the_step_named(run):
    flip(run / "checkpoint" / "step_00000008" / "__0_0.distcp")
    refused = run_cli("train", "--out", str(run), "--resume")
    assert refused.returncode == 2, refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint ") and "__0_0.distcp" in last
    assert "--resume-from step_6" in last
    bad = run_cli("train", "--out", str(run), "--resume-from", "six")
    assert bad.returncode == 2 and "is not a checkpoint step" in bad.stderr
    resumed = run_cli("train", "--out", str(run), "--resume-from", "step_00000006")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "set aside" in resumed.stderr and "step_00000008.superseded" in resumed.stderr
    assert json.loads((run / "summary.json").read_text())["completed"]


def test_a_resume_hashes_its_checkpoint_once(run, monkeypatch):
    """``resume_point`` checks the checkpoint; the load that follows does not hash it again."""
    from towerrec.train import checkpoint as checkpoint_module

    checked = []
    real = checkpoint_module._verify_together

    def counting(path):
        checked.append(path)
        return real(path)

    monkeypatch.setattr(checkpoint_module, "_verify_together", counting)
    trainer.train(quick_config(*SETTINGS, "train.steps=10"), run, resume=True)
    assert checked.count(run / "checkpoint" / "step_00000008") == 1


QUICK = Path(__file__).parent.parent / "configs" / "quick.toml"
TWO_RANKS = (
    *SETTINGS[:2],
    "train.eval_every=0",
    "train.progress=false",
    "data.synthetic.eval_samples=2048",
    "train.eval_batch_size=1024",
)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_refuse_a_damaged_latest_and_resume_from_the_previous_when_asked(tmp_path):
    """As on one process, with rank 1's shard of the latest checkpoint damaged: every
    rank refuses it naming the file and the previous intact step; ``--resume-from step_6
    --nproc 2`` ends where the uninterrupted 2-rank run ends, bit for bit."""
    sets = [a for s in TWO_RANKS for a in ("--set", s)]
    full = run_cli(
        "train", "--config", str(QUICK), *sets, "--nproc", "2", "--out", str(tmp_path / "full")
    )
    assert full.returncode == 0, full.stderr[-3000:]
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "full", run)
    assert CheckpointManager(run / "checkpoint").steps() == [6, 8]
    flip(run / "checkpoint" / "step_00000008" / "__1_0.distcp")
    before = snapshot(run)

    refused = run_cli("train", "--out", str(run), "--resume", "--nproc", "2")
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert "step_00000008 is damaged" in last and "__1_0.distcp does not match" in last
    assert "--resume-from step_6" in last
    assert snapshot(run) == before  # the refusal changed nothing

    resumed = run_cli("train", "--out", str(run), "--resume-from", "step_6", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000008.superseded" in resumed.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 8
    assert [r for r in _records(run) if r["kind"] == "resume"] == [
        {"kind": "resume", "step": 6, "changed": {}}
    ]
    config = load_config(QUICK, list(TWO_RANKS))
    expected, final = final_state(tmp_path / "full", config), final_state(run, config)
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key
