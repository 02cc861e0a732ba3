"""DANCE: conjugate gradient, the stage rule, 2 ranks against one process, its
settings' errors, and training runs (with PB-L-BFGS on 2 ranks too) through the
command line."""

import copy
import json
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli

from towerrec.config import load_config
from towerrec.distributed.launch import spawn_world
from towerrec.optim.dance import Dance, DanceSettings, conjugate_gradient
from towerrec.optim.sampled import TensorSamples, flat_parameters

ROWS, CHUNK = 3001, 100  # a last chunk of 1 row, and rows not a multiple of 2 ranks


def test_conjugate_gradient_solves_a_positive_definite_system_in_its_dimension():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    matrix = a @ a.T + torch.eye(5, dtype=torch.float64)
    rhs = torch.randn(5, generator=generator, dtype=torch.float64)
    v, residual, products = conjugate_gradient(lambda p: matrix @ p, rhs, 5, 1e-12)
    torch.testing.assert_close(v, torch.linalg.solve(matrix, rhs))
    assert products <= 5 and float(residual.norm()) < 1e-8


def test_negative_curvature_at_the_first_direction_falls_back_to_the_gradient():
    rhs = torch.tensor([1.0, 2.0], dtype=torch.float64)
    v, _, products = conjugate_gradient(lambda p: -p, rhs, 5, 0.1)
    assert torch.equal(v, rhs) and products == 1


def _problem(rank=0, world_size=1, first=0):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 8, generator=generator, dtype=torch.float64)
    truth = torch.randn(8, generator=generator, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(x @ truth), generator=generator)
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)

    def loss(index):
        return F.binary_cross_entropy_with_logits(x[index] @ w, y[index], reduction="none")

    return w, TensorSamples(
        loss, [w], ROWS, CHUNK, seed=2, rank=rank, world_size=world_size, first=first
    )


def _iterates(topology=None, iterations=12):
    reducer = None
    if topology is not None:
        from towerrec.distributed.sum_reduce import GroupReducer

        reducer = GroupReducer()
    rank, world = (topology.rank, topology.world_size) if topology else (0, 1)
    w, samples = _problem(rank, world)
    optimizer = Dance([w], settings=DanceSettings(initial_chunks=1), reducer=reducer)
    reports, points = [], []
    for _ in range(iterations):
        reports.append(optimizer.iterate(samples))
        points.append(flat_parameters([w]))
    return points, reports, optimizer.stages


def test_stages_grow_the_sample_to_the_data_set_and_report_their_work():
    points, reports, stages = _iterates()
    samples = [r["stage_samples"] for r in reports]
    assert all(a <= b for a, b in pairwise(samples))
    assert samples[0] == CHUNK and samples[-1] == ROWS  # 1 chunk, then all 31
    assert [s["samples"] for s in stages] == [100, 200, 400, 800, 1600][: len(stages)]
    for report in reports:  # a switch happens only once the stage's accuracy is reached
        if report["stage_switched"]:
            assert report["stage_samples"] > CHUNK
    assert all(s["newton_iterations"] >= 1 and s["cg_iterations"] >= 1 for s in stages)
    last = reports[-1]
    assert last["fresh_samples"] == ROWS  # every row drawn once
    assert last["grad_samples"] > ROWS and last["hvp_samples"] > 0
    assert float((points[-1] - points[-2]).norm()) < 1e-6  # converged on the whole data


def test_a_run_resumed_from_its_state_dict_ends_bit_for_bit_like_the_whole_run():
    """The stage, its sample and counters travel in state_dict(): a new optimizer
    loaded from it, on samples that go on at its next chunk, takes the uninterrupted
    run's iterations exactly, in the middle of a stage."""
    settings = DanceSettings(initial_chunks=1, accuracy_exponent=1.0)  # stages of 2-4 steps
    w, samples = _problem()
    whole = Dance([w], settings=settings)
    reports = [whole.iterate(samples) for _ in range(9)]
    w1, samples1 = _problem()
    first = Dance([w1], settings=settings)
    for _ in range(5):
        first.iterate(samples1)
    saved = copy.deepcopy(first.state_dict())
    held, next_chunk = first.chunk_position()
    w2, samples2 = _problem(first=next_chunk)
    with torch.no_grad():
        w2.copy_(w1)
    resumed = Dance([w2], settings=settings)
    resumed.load_state_dict(saved)
    assert resumed.chunk_position() == (held, next_chunk) and len(held) > 1
    later = [resumed.iterate(samples2) for _ in range(4)]
    assert later[0]["stage"] == 1 and later[0]["newton_in_stage"] == 2  # inside a stage
    assert any(r["stage_switched"] for r in later)  # and on into the next ones
    assert later == reports[5:]
    assert torch.equal(w2, w)


@pytest.mark.multiprocess
def test_two_ranks_take_the_single_process_iterates():
    points, reports, _ = _iterates()
    for two_points, two_reports, _ in spawn_world(_iterates, 2, 1):
        for one, two in zip(points, two_points, strict=True):
            torch.testing.assert_close(two, one, rtol=0, atol=1e-6)
        assert [r["stage_samples"] for r in two_reports] == [r["stage_samples"] for r in reports]


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.dance.growth=1.0", "growth must be > 1"),
        ("optimizer.dance.cg_tolerance=0", "cg_tolerance must lie in"),
        ("optimizer.dance.initial_chunks=0", "initial_chunks and cg_iterations must be >= 1"),
        ("optimizer.dance.regularization=-1", "regularization and accuracy_exponent"),
    ],
)
def test_bad_settings_are_refused_with_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


COMMON = [
    "optimizer.warmup_steps=0",
    "optimizer.decay=none",
    "train.steps=3",
    "train.progress=false",
    "train.eval_batch_size=4096",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, extra",
    [
        (None, ["train.batch_size=256", "data.synthetic.num_dense=4"]),
        ("configs/movielens.toml", ["train.batch_size=512"]),
    ],
    ids=["synthetic", "movielens"],
)
def test_towerrec_train_with_dance_reports_its_stages(tmp_path, config, extra):
    sets = [x for s in ["optimizer.name=dance", *COMMON, *extra] for x in ("--set", s)]
    args = ["train", "--out", str(tmp_path / "run"), *sets]
    result = run_cli(*(args + (["--config", config] if config else [])), OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if r["kind"] == "optimizer"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["cg_iterations"] >= 1 and r["stage_samples"] > 0 for r in steps)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["completed"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["pb_lbfgs", "dance"])
def test_movielens_on_2_ranks_follows_one_process(tmp_path, name):
    overrides = [f"optimizer.name={name}", *COMMON]
    sets = [x for s in overrides for x in ("--set", s)]
    result = run_cli(
        "train", "--config", "configs/movielens.toml", "--nproc", "2",
        "--out", str(tmp_path / "two"), *sets, OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    from towerrec.workflows import training as trainer

    one = trainer.train(load_config("configs/movielens.toml", overrides), tmp_path / "one")
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert abs(two["auc"] - one["auc"]) < 1e-3 and abs(two["logloss"] - one["logloss"]) < 1e-3
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").open()]
    ones = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").open()]
    two_steps = [r for r in records if r["kind"] == "optimizer"]
    one_steps = [r for r in ones if r["kind"] == "optimizer"]
    for a, b in zip(one_steps, two_steps, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4
