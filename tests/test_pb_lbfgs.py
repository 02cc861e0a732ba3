"""Progressive-batching L-BFGS: the two-loop recursion against the explicit BFGS
matrix, the sample that never shrinks, the curvature skip rule, a failing line
search's error, and training runs through the command line."""

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


@pytest.mark.slow
def test_a_resumed_run_continues_with_a_new_history(tmp_path):
    from towerrec.train import trainer

    overrides = [
        "optimizer.name=pb_lbfgs",
        "optimizer.warmup_steps=0",
        "optimizer.decay=none",
        "train.progress=false",
        "train.batch_size=256",
        "data.synthetic.num_dense=4",
        "train.checkpoint_every=2",
    ]
    trainer.train(load_config(None, [*overrides, "train.steps=2"]), tmp_path)
    summary = trainer.train(load_config(None, [*overrides, "train.steps=3"]), tmp_path, resume=True)
    assert summary["completed"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    steps = [r for r in records if r["kind"] == "optimizer"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[1]["pairs"] + steps[1]["pair_skipped"] == 1  # a pair kept or skipped
    assert steps[2]["pairs"] == steps[2]["pair_skipped"] == 0  # no history in the checkpoint


def test_the_batch_pipeline_is_refused_with_the_fix(tmp_path):
    from towerrec.train import trainer

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
    from towerrec.train import trainer

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
