"""Verified checkpoints: every checkpoint carries ``checksums.json``; a load refuses a
damaged or incomplete one (bytes flipped, a file truncated, a shard file or the
checksums missing) naming the file, on one process and on 2 ranks (each rank's shard
covered, every rank refusing together), and the refusal changes nothing on disk."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_cases import plan_all
from test_parallelize import TABLES, build
from torch.distributed.device_mesh import init_device_mesh

from towerrec.checksums import (
    CHECKSUMS,
    ChecksumError,
    assign,
    digests,
    list_files,
    problems,
    read_checksums,
    write_checksums,
)
from towerrec.distributed.launch import spawn_world
from towerrec.distributed.parallelize import parallelize
from towerrec.modules.embedding_bag import dense_parameters
from towerrec.sharding import ShardingType
from towerrec.train.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint


def flip(file: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``file`` (its size unchanged)."""
    data = bytearray(file.read_bytes())
    mid = max(0, len(data) // 2 - count // 2)
    for i in range(mid, min(len(data), mid + count)):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


# kind -> (what is done to a checkpoint directory, what the refusal must name)
CORRUPTIONS = {
    "flipped bytes": (lambda d: flip(d / "__0_0.distcp"), "__0_0.distcp does not match"),
    "truncated": (lambda d: truncate(d / "__0_0.distcp"), r"__0_0.distcp has \d+ bytes"),
    "missing shard file": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    "missing .metadata": (lambda d: (d / ".metadata").unlink(), r"\.metadata is missing"),
    "flipped meta.json": (lambda d: flip(d / "meta.json", 2), "meta.json does not match"),
    "missing checksums": (lambda d: (d / CHECKSUMS).unlink(), "checksums.json is missing"),
    "malformed checksums": (lambda d: truncate(d / CHECKSUMS), "checksums.json is unreadable"),
}


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with the SHA-256 of its bytes."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _model_and_optimizer(seed=0):
    model = build(seed=seed)
    return model, torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-process checkpoint of step 3 (with meta.json) and its model's weights."""
    directory = tmp_path_factory.mktemp("saved")
    model, optimizer = _model_and_optimizer()
    CheckpointManager(directory).save(3, model, optimizer, {"step": 3}, meta={"threads": 1})
    return directory / "step_00000003", model.state_dict()


def _copy(saved, tmp_path):
    path = tmp_path / "checkpoint" / saved[0].name
    shutil.copytree(saved[0], path)
    return path


def test_a_checkpoint_lists_every_file_it_holds(saved):
    path, _ = saved
    entries = read_checksums(path)
    assert entries is not None
    assert sorted(entries) == list_files(path)
    assert {".metadata", "__0_0.distcp", "meta.json"} <= set(entries)
    assert entries == digests(path, list_files(path))
    verify_checkpoint(path)  # intact


def test_an_intact_checkpoint_loads(saved, tmp_path):
    path, weights = saved
    model, optimizer = _model_and_optimizer(seed=5)
    train = CheckpointManager(path.parent).load(path, model, optimizer, {"step": 0})
    assert train["step"] == 3
    for key, value in weights.items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_left_as_it_is(kind, saved, tmp_path):
    path = _copy(saved, tmp_path)
    damage, named = CORRUPTIONS[kind]
    damage(path)
    before = snapshot(path.parent)
    model, optimizer = _model_and_optimizer(seed=5)
    untouched = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=named) as refused:
        CheckpointManager(path.parent).load(path, model, optimizer, {"step": 0})
    assert str(path) in str(refused.value) and refused.value.path == path
    with pytest.raises(CheckpointError, match=named):
        verify_checkpoint(path)
    assert snapshot(path.parent) == before  # nothing deleted or rewritten
    for key, value in untouched.items():  # nothing loaded
        assert torch.equal(model.state_dict()[key], value), key


def test_the_missing_checksums_message_names_the_fix(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match=r"train\.verify_checkpoints=false"):
        verify_checkpoint(path)


def test_a_checkpoint_without_checksums_loads_when_verification_is_off(saved, tmp_path):
    """A checkpoint of a towerrec before checksums: ``verify=False`` takes it as it is."""
    path, weights = saved
    path = _copy(saved, tmp_path)
    (path / CHECKSUMS).unlink()
    model, optimizer = _model_and_optimizer(seed=5)
    CheckpointManager(path.parent, verify=False).load(path, model, optimizer, {"step": 0})
    for key, value in weights.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_intact_before_skips_damaged_checkpoints_and_set_aside_keeps_them(saved, tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (2, 4, 6):
        shutil.copytree(saved[0], manager.path(step))
    flip(manager.path(4) / "__0_0.distcp")
    flip(manager.path(6) / "__0_0.distcp")
    assert manager.intact_before(6) == 2
    assert manager.intact_before(2) is None
    before = snapshot(tmp_path)
    moved = manager.set_aside_after(2)
    assert [p.name for p in moved] == ["step_00000004.superseded", "step_00000006.superseded"]
    assert manager.steps() == [2] and manager.latest() == manager.path(2)
    renamed = {k.replace(".superseded", ""): v for k, v in snapshot(tmp_path).items()}
    assert renamed == before  # renamed, every byte kept
    shutil.copytree(saved[0], manager.path(4))  # set aside a second time: another name
    assert [p.name for p in manager.set_aside_after(2)] == ["step_00000004.superseded2"]


def test_checksums_of_a_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub" / "b.bin").write_bytes(b"")
    write_checksums(tmp_path, digests(tmp_path, list_files(tmp_path)))
    entries = read_checksums(tmp_path)
    assert entries is not None and sorted(entries) == ["a.bin", "sub/b.bin"]
    assert entries["a.bin"]["sha256"] == hashlib.sha256(b"x" * 1000).hexdigest()
    assert problems(tmp_path, entries) == []
    (tmp_path / "extra").write_text("not listed, not read back")
    assert problems(tmp_path, entries) == []
    (tmp_path / "a.bin").write_bytes(b"x" * 999 + b"y")
    (tmp_path / "sub" / "b.bin").unlink()
    assert problems(tmp_path, entries) == [
        "a.bin does not match its sha256 in checksums.json",
        "sub/b.bin is missing",
    ]
    assert read_checksums(tmp_path / "sub") is None
    for text in ("{", "[]", json.dumps({"format": "towerrec-checksums", "version": 9})):
        (tmp_path / CHECKSUMS).write_text(text)
        with pytest.raises(ChecksumError, match=r"checksums\.json is unreadable"):
            read_checksums(tmp_path)


def test_the_files_are_shared_out_by_size():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    shares = assign(sizes, 2)
    assert shares == [["a", "d", "e"], ["b", "c"]]  # 110 bytes each, largest first
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    assert assign(sizes, 2) == shares  # the same split on every rank
    assert assign({}, 3) == [[], [], []]


# Two ranks: each saves its shards (table-wise: each rank holds whole tables), rank 0
# writes checksums.json for all of them; every rank refuses a damaged copy together.
RANK_CORRUPTIONS = {
    "flipped bytes of rank 1": (lambda d: flip(d / "__1_0.distcp"), "__1_0.distcp does not match"),
    "truncated rank 0": (lambda d: truncate(d / "__0_0.distcp"), r"__0_0.distcp has \d+ bytes"),
    "missing rank 1": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "missing checksums": (lambda d: (d / CHECKSUMS).unlink(), "checksums.json is missing"),
}


def _sharded(topology, seed):
    mesh = init_device_mesh("cpu", (topology.hosts, topology.ranks_per_host))
    model = parallelize(build(seed=seed), mesh, plan_all(ShardingType.TABLE_WISE, topology, TABLES))
    return model, torch.optim.Adam([p for _, p in dense_parameters(model)], lr=0.01)


def _save_then_load_damaged_copies(topology, root):
    model, optimizer = _sharded(topology, seed=1)
    manager = CheckpointManager(root / "saved")
    path = manager.save(3, model, optimizer, {"step": 3}, meta={"threads": 1})
    listed = sorted(read_checksums(path) or {})
    if topology.rank == 0:
        for kind, (damage, _) in RANK_CORRUPTIONS.items():
            copy = root / kind / "step_00000003"
            shutil.copytree(path, copy)
            damage(copy)
    dist.barrier()
    refusals = {}
    for kind in RANK_CORRUPTIONS:
        loaded, loaded_optimizer = _sharded(topology, seed=2)
        copy = root / kind / "step_00000003"
        try:
            CheckpointManager(copy.parent).load(copy, loaded, loaded_optimizer, {"step": 0})
            refusals[kind] = None
        except CheckpointError as e:
            refusals[kind] = str(e)
    loaded, loaded_optimizer = _sharded(topology, seed=2)
    train = manager.load(path, loaded, loaded_optimizer, {"step": 0})  # the intact one loads
    return listed, refusals, train["step"]


@pytest.mark.multiprocess
def test_two_ranks_cover_every_shard_and_refuse_a_damaged_checkpoint_together(tmp_path):
    results = spawn_world(_save_then_load_damaged_copies, 2, 1, tmp_path)
    (listed, refusals, step), (listed_1, refusals_1, step_1) = results
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json"} <= set(listed)
    assert listed == listed_1 == list_files(tmp_path / "saved" / "step_00000003")
    assert refusals == refusals_1  # every rank refuses, with the same message
    for kind, (_, named) in RANK_CORRUPTIONS.items():
        assert refusals[kind] is not None, kind
        assert re.search(named, refusals[kind]), (kind, refusals[kind])
    assert step == step_1 == 3
