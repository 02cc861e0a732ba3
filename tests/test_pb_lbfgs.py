"""Progressive-batching L-BFGS: the two-loop recursion against the explicit BFGS
matrix, the sample that never shrinks, the curvature skip rule, a failing line
search's error, and training runs through the command line."""

import copy
import json
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli

from towerrec.config import load_config
from towerrec.optim.pb_lbfgs import (
    LineSearchError,
    PBLBFGSSettings,
    ProgressiveBatchLBFGS,
    two_loop,
)
from towerrec.optim.sampled import TensorSamples


def _explicit_inverse_hessian(pairs, dim):
    """H_0 = gamma I (gamma of the newest pair), then the BFGS update per pair, oldest first:
    H <- (I - rho s y') H (I - rho y s') + rho s s'."""
    s_last, y_last = pairs[-1]
    h = torch.eye(dim, dtype=torch.float64) * (s_last @ y_last) / (y_last @ y_last)
    for s, y in pairs:
        rho = 1 / (y @ s)
        left = torch.eye(dim, dtype=torch.float64) - rho * torch.outer(s, y)
        h = left @ h @ left.T + rho * torch.outer(s, s)
    return h


def test_the_two_loop_recursion_equals_the_explicit_bfgs_matrix_on_a_quadratic():
    generator = torch.Generator().manual_seed(0)
    dim = 6
    a = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    hessian = a @ a.T + dim * torch.eye(dim, dtype=torch.float64)  # a quadratic's Hessian
    steps = [torch.randn(dim, generator=generator, dtype=torch.float64) for _ in range(4)]
    pairs = [(s, hessian @ s) for s in steps]  # y = grad(w + s) - grad(w) = A s
    g = torch.randn(dim, generator=generator, dtype=torch.float64)
    explicit = _explicit_inverse_hessian(pairs, dim) @ g
    recursion = two_loop(g, [s for s, _ in pairs], [y for _, y in pairs])
    torch.testing.assert_close(recursion, explicit, rtol=1e-10, atol=1e-12)
    assert torch.equal(two_loop(g, [], []), g)  # no pairs: H_0 = I


def _logistic(rows=4000, dim=20, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=generator, dtype=torch.float64)
    truth = torch.randn(dim, generator=generator, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(x @ truth), generator=generator)
    w = torch.zeros(dim, dtype=torch.float64, requires_grad=True)

    def loss(index):
        return F.binary_cross_entropy_with_logits(x[index] @ w, y[index], reduction="none")

    return w, loss


def _sizes_and_losses(theta, iterations=30):
    w, loss = _logistic()
    samples = TensorSamples(loss, [w], rows=4000, chunk_size=100)
    settings = PBLBFGSSettings(initial_chunks=2, theta=theta)
    optimizer = ProgressiveBatchLBFGS([w], settings=settings)
    sizes, losses = [], []
    for _ in range(iterations):
        sizes.append(optimizer.iterate(samples)["batch_size"])
        with torch.no_grad():
            losses.append(float(loss(torch.arange(4000)).mean()))
    return sizes, losses


def test_the_sample_never_shrinks_and_grows_to_the_data_set_as_the_loss_converges():
    w, loss = _logistic()
    full = ProgressiveBatchLBFGS([w], settings=PBLBFGSSettings(initial_chunks=40))
    for _ in range(20):  # full-batch L-BFGS: the minimum
        full.iterate(TensorSamples(loss, [w], rows=4000, chunk_size=100))
    with torch.no_grad():
        minimum = float(loss(torch.arange(4000)).mean())
    for theta in (0.5, 0.1):
        sizes, losses = _sizes_and_losses(theta)
        assert all(a <= b for a, b in pairwise(sizes))
        assert sizes[0] == 200 and sizes[-1] > 200
        assert losses[-1] - minimum < 0.01
    # A strict test grows the sample to all 40 chunks (the cap), which ends at the minimum.
    assert sizes[-1] == 4000 and losses[-1] - minimum < 1e-9


def test_a_run_resumed_from_its_state_dict_ends_bit_for_bit_like_the_whole_run():
    """The history (pairs, w_{k-1} and the overlap's gradient), the sample and the
    counters travel in state_dict(): a new optimizer loaded from it, on samples that go
    on at its next chunk, takes the uninterrupted run's iterations exactly."""
    settings = PBLBFGSSettings(initial_chunks=4, history=3)

    def start():
        w, loss = _logistic(rows=1000, dim=10)
        optimizer = ProgressiveBatchLBFGS([w], settings=settings)
        return w, loss, optimizer

    w, loss, whole = start()
    samples = TensorSamples(loss, [w], rows=1000, chunk_size=50)
    reports = [whole.iterate(samples) for _ in range(8)]
    w1, loss1, first = start()
    samples1 = TensorSamples(loss1, [w1], rows=1000, chunk_size=50)
    for _ in range(4):
        first.iterate(samples1)
    saved = copy.deepcopy(first.state_dict())
    w2, loss2, resumed = start()
    with torch.no_grad():
        w2.copy_(w1)
    resumed.load_state_dict(saved)
    held, next_chunk = resumed.chunk_position()
    assert held and held[-1] + 1 == next_chunk
    samples2 = TensorSamples(loss2, [w2], rows=1000, chunk_size=50, first=next_chunk)
    later = [resumed.iterate(samples2) for _ in range(4)]
    assert later[0]["pairs"] >= 2  # the history came along
    assert later == reports[4:]
    assert torch.equal(w2, w)


def test_a_pair_without_positive_curvature_is_skipped():
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)

    def concave_then(index):  # -|w - t|^2: every pair has s'y < 0
        return -((w - target) ** 2).sum().expand(len(index)) + 0 * index

    samples = TensorSamples(concave_then, [w], rows=8, chunk_size=2)
    optimizer = ProgressiveBatchLBFGS([w], settings=PBLBFGSSettings(initial_chunks=2))
    optimizer.iterate(samples)
    report = optimizer.iterate(samples)
    assert report["pair_skipped"] == 1 and report["pairs"] == 0


def test_a_line_search_that_keeps_failing_raises_a_clear_error():
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    calls = {"n": 0}

    def rising(index):  # the gradient says "go right", every trial point is worse
        calls["n"] += 1
        moved = (w != 0).any()
        return (-w.sum() + (10.0 if moved else 0.0)).expand(len(index)) + 0 * index

    samples = TensorSamples(rising, [w], rows=8, chunk_size=2)
    settings = PBLBFGSSettings(initial_chunks=2, max_backtracks=3)
    optimizer = ProgressiveBatchLBFGS([w], settings=settings)
    with pytest.raises(LineSearchError, match="no decrease of the sampled loss after 3 trials"):
        optimizer.iterate(samples)
    assert torch.equal(w.detach(), torch.zeros(2, dtype=torch.float64))  # left where it was


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.pb_lbfgs.initial_chunks=1", "initial_chunks must be >= 2"),
        ("optimizer.pb_lbfgs.overlap=1.0", "overlap must lie in"),
        ("optimizer.pb_lbfgs.theta=0", "theta must be > 0"),
        ("optimizer.pb_lbfgs.max_chunks=3", "max_chunks = 3 is below initial_chunks"),
        ("optimizer.name=lbfgs", "optimizer.name"),
    ],
)
def test_bad_settings_are_refused_with_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_the_plain_step_points_to_iterate():
    w = torch.zeros(2, requires_grad=True)
    with pytest.raises(TypeError, match="iterate"):
        ProgressiveBatchLBFGS([w]).step()


COMMON = [
    "optimizer.name=pb_lbfgs",
    "optimizer.warmup_steps=0",
    "optimizer.decay=none",
    "train.steps=4",
    "train.eval_every=2",
    "train.progress=false",
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
def test_towerrec_train_logs_batch_size_step_and_skipped_pairs(tmp_path, config, extra):
    sets = [x for s in COMMON + extra for x in ("--set", s)]
    args = ["train", "--out", str(tmp_path / "run"), *sets]
    result = run_cli(*(args + (["--config", config] if config else [])), OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if r["kind"] == "optimizer"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["batch_size"] >= 4 * (256 if config is None else 512) - 1
        assert r["step_length"] > 0 and r["pair_skipped"] in (0, 1)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"]


def _final_weights(run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = sorted((run / "checkpoint").glob("step_*"))[-1]
    dcp_to_torch_save(latest, run / "final.pt")
    return torch.load(run / "final.pt", weights_only=False)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pb_lbfgs", "dance"])
def test_a_run_stopped_and_resumed_ends_bit_for_bit_like_the_whole_run(tmp_path, name):
    """The checkpoint holds the history or stage and the sample's chunks; the resumed
    run draws those chunks again and goes on in the stream where the optimizer was."""
    from towerrec.workflows import training as trainer

    overrides = [
        f"optimizer.name={name}",
        "optimizer.warmup_steps=0",
        "optimizer.decay=none",
        "optimizer.dance.accuracy_exponent=1.0",
        "train.progress=false",
        "train.eval_every=0",
        "optimizer.pb_lbfgs.max_chunks=8",
        "optimizer.dance.max_chunks=8",
        "train.batch_size=128",
        "train.steps=5",
        "data.synthetic.num_dense=4",
        "data.synthetic.num_embeddings=[100, 50, 200, 20]",
        "data.synthetic.pooling_factors=[1, 1, 2, 1]",
        "data.synthetic.eval_samples=4096",
    ]
    config = load_config(None, overrides)
    whole = trainer.train(config, tmp_path / "whole")
    trainer.train(config, tmp_path / "split", stop_after=3)
    resumed = trainer.train(config, tmp_path / "split", resume=True)
    assert resumed["auc"] == whole["auc"] and resumed["logloss"] == whole["logloss"]

    def steps(run):
        records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
        return {r["step"]: r for r in records if r["kind"] == "optimizer"}

    after, before = steps(tmp_path / "split"), steps(tmp_path / "whole")
    assert sorted(after) == [1, 2, 3, 4, 5]
    assert [after[k] for k in (4, 5)] == [before[k] for k in (4, 5)]
    if name == "pb_lbfgs":
        assert after[4]["pairs"] >= 1  # the history came along
    else:
        assert after[4]["newton_in_stage"] >= 2  # inside the stage it stopped in
    ours, theirs = _final_weights(tmp_path / "split"), _final_weights(tmp_path / "whole")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_batch_pipeline_is_refused_with_the_fix(tmp_path):
    from towerrec.workflows import training as trainer

    config = load_config(
        None,
        [
            "optimizer.name=pb_lbfgs",
            "distributed.pipeline=true",
            "train.steps=1",
            "train.progress=false",
            "train.batch_size=64",
        ],
    )
    with pytest.raises(ValueError, match=r"set distributed\.pipeline = false"):
        trainer.train(config, tmp_path)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_criteo_format_cache_on_2_ranks_follows_one_process(tmp_path):
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo
    from towerrec.data.criteo_gen import generate_criteo_files
    from towerrec.workflows import training as trainer

    days = generate_criteo_files(tmp_path / "raw", files=2, rows_per_file=801, seed=3)
    cache = tmp_path / "cache"
    options = CriteoOptions(num_embeddings=(500,), eval_files=("day_1",))
    preprocess_criteo(days, cache, options, progress=False)
    overrides = [
        "data.source=criteo",
        f"data.path={cache}",
        "optimizer.name=pb_lbfgs",
        "optimizer.warmup_steps=0",
        "optimizer.decay=none",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16, 8]",
        "model.top_mlp=[16, 1]",
        "train.batch_size=128",
        "train.steps=4",
        "train.progress=false",
    ]
    sets = [x for s in overrides for x in ("--set", s)]
    result = run_cli(
        "train", "--nproc", "2", "--out", str(tmp_path / "two"), *sets, OMP_NUM_THREADS="1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = trainer.train(load_config(None, overrides), tmp_path / "one")
    assert two["eval_samples"] == one["eval_samples"] == 801  # uneven over 2 ranks
    assert abs(two["auc"] - one["auc"]) < 1e-3
    assert abs(two["logloss"] - one["logloss"]) < 1e-3
