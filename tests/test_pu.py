"""Positive-unlabeled learning: the PU losses, class-prior estimation, the MovieLens PU view."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli

from towerrec.config import ConfigError, LossConfig, load_config
from towerrec.data.batch import Batch, DataSchema, SparseFeature
from towerrec.data.cache import ColumnStore, SplitColumns
from towerrec.data.loader import ColumnSource
from towerrec.data.movielens import MovieLensConfig, hide_positives, load_movielens
from towerrec.models.dcn import DCN, DCNConfig
from towerrec.models.dlrm import DLRM
from towerrec.modules.embedding_bag import EmbeddingBagCollection
from towerrec.modules.tables import TableConfig
from towerrec.sparse import KeyedJaggedTensor
from towerrec.train.loss import (
    BCE,
    LossKind,
    Objective,
    pu_bce,
    punce_contrastive,
)
from towerrec.train.step import train_step
from towerrec.workflows import training as trainer
from towerrec.workflows.pu.prior import estimate_class_prior, estimate_prior


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# ------------------------------------------------------------------ the losses
def test_pu_bce_equals_its_hand_computed_value():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    prior = 0.3
    # labelled positive: -log sigmoid(x) = softplus(-x); unlabelled: a positive of weight
    # prior and a negative of weight 1 - prior (-log(1 - sigmoid(x)) = softplus(x))
    expected = (
        _softplus(-2.0)
        + (prior * _softplus(1.0) + (1 - prior) * _softplus(-1.0))
        + (prior * _softplus(-0.5) + (1 - prior) * _softplus(0.5))
        + _softplus(-0.0)
    ) / 4
    assert pu_bce(logits, labels, prior).item() == pytest.approx(expected, rel=1e-6)


def test_punce_contrastive_equals_its_hand_computed_value():
    h = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 2.0], [-1.0, 1.0]])
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    prior, tau = 0.25, 0.5
    z = [[v / math.hypot(*row) for v in row] for row in h.tolist()]
    sim = [[(a[0] * b[0] + a[1] * b[1]) / tau for b in z] for a in z]
    pos = [1.0 if y else prior for y in labels.tolist()]
    total = 0.0
    for i in range(4):
        others = [j for j in range(4) if j != i]
        norm = math.log(sum(math.exp(sim[i][j]) for j in others))
        for member in (pos, [1 - p for p in pos]):
            mass = sum(member[j] for j in others)
            if mass == 0:
                continue
            ce = -sum(member[j] * (sim[i][j] - norm) for j in others) / mass
            total += member[i] * ce
    got = punce_contrastive(h, labels, prior, tau).item()
    assert got == pytest.approx(total / 4, rel=1e-6)


def _dlrm(seed: int = 0) -> DLRM:
    torch.manual_seed(seed)
    tables = [TableConfig("a", 20, 4), TableConfig("b", 15, 4)]
    return DLRM(EmbeddingBagCollection(tables, backend="torch"), 3, (8, 4), (8, 1))


def _batch(seed: int, size: int = 16) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat(
        [torch.randint(0, 20, (size,), generator=g), torch.randint(0, 15, (size,), generator=g)]
    )
    sparse = KeyedJaggedTensor(["a", "b"], ids, torch.ones(2 * size, dtype=torch.long))
    labels = (torch.rand(size, generator=g) < 0.4).float()
    return Batch(torch.randn(size, 3, generator=g), sparse, labels)


def test_the_default_loss_is_bce_bit_for_bit():
    """train_step with no objective (and with Objective()) takes the steps the plain
    ``binary_cross_entropy_with_logits`` step takes, bit for bit."""
    models = [_dlrm(), _dlrm(), _dlrm()]
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    for step in range(4):
        batch = _batch(step)
        logits = models[0](batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        optimizers[0].zero_grad(set_to_none=True)
        loss.backward()
        optimizers[0].step()
        assert torch.equal(train_step(models[1], optimizers[1], batch), loss.detach())
        assert torch.equal(train_step(models[2], optimizers[2], batch, None, BCE), loss.detach())
    for a, b, c in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_punce_reads_the_dlrm_top_mlp_input_and_trains():
    model = _dlrm()
    objective = Objective(LossKind.PUNCE, 0.3, contrastive_weight=0.5, temperature=0.5)
    batch = _batch(0)
    logits, representation = objective.forward(model, batch)
    top = model.top
    assert representation is not None
    assert representation.shape == (16, top.in_features + top.input_padding)
    expected = pu_bce(logits, batch.labels, 0.3) + 0.5 * punce_contrastive(
        representation, batch.labels, 0.3, 0.5
    )
    assert objective.loss(logits, representation, batch.labels).item() == pytest.approx(
        expected.item(), rel=1e-6
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    assert torch.isfinite(train_step(model, optimizer, batch, None, objective))


def test_punce_on_a_model_without_a_representation_is_a_clear_error():
    tables = [TableConfig("a", 20, 4), TableConfig("b", 15, 4)]
    dcn = DCN(EmbeddingBagCollection(tables, backend="torch"), 3, (8, 4), (8, 1), DCNConfig())
    objective = Objective(LossKind.PUNCE, 0.3)
    with pytest.raises(ValueError, match=r"needs a model with a representation.*dlrm"):
        objective.forward(dcn, _batch(0))
    with pytest.raises(
        ValueError, match=r"loss\.kind = 'punce' needs a model with a representation"
    ):
        load_config(None, ["model.name=dcn", "loss.kind=punce", "loss.class_prior=0.3"])


@pytest.mark.parametrize(
    "sets, message",
    [
        (["loss.kind=pu_bce", "loss.class_prior=1.5"], "must lie strictly between 0 and 1"),
        (["loss.kind=pu_bce", "loss.class_prior=0"], "must lie strictly between 0 and 1"),
        (["loss.kind=punce", "loss.class_prior=-0.2"], "must lie strictly between 0 and 1"),
        (
            ["loss.kind=pu_bce", "loss.class_prior=guess"],
            'give a number in \\(0, 1\\) or "estimate"',
        ),
        (["loss.kind=pu_bce"], "needs loss.class_prior"),
        (["loss.kind=hinge"], "loss.kind = 'hinge' is not one of"),
        (["loss.kind=punce", "loss.class_prior=0.3", "loss.temperature=0"], "temperature"),
        (["data.movielens.pu_hide_fraction=1.0"], "pu_hide_fraction must lie in \\[0, 1\\)"),
    ],
)
def test_bad_loss_settings_are_refused_naming_the_fix(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_a_prior_outside_0_1_is_refused_by_the_loss_itself():
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        pu_bce(torch.zeros(2), torch.tensor([1.0, 0.0]), 1.0)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        Objective(LossKind.PU_BCE, 0.0)


def test_a_class_prior_with_bce_warns_that_it_is_ignored():
    with pytest.warns(UserWarning, match="loss.class_prior is ignored"):
        LossConfig(kind="bce", class_prior=0.3)


# ------------------------------------------------------------------ prior estimation
def test_a_planted_prior_is_recovered_from_oracle_scores():
    """Planted: P(positive | x) = 1 on a fifth of x, 0.25 elsewhere (prior 0.4); each
    positive labelled with c = 0.5; the scores are the ideal classifier's c P(pos | x).
    200,000 examples put 4,000 in the top 2 %: the estimate's standard deviation is about
    0.006, and the tolerance 0.03 is five of them."""
    rng = np.random.default_rng(7)
    n = 200_000
    pure = rng.random(n) < 0.2
    f = np.where(pure, 1.0, 0.25)
    y = rng.random(n) < f
    s = y & (rng.random(n) < 0.5)
    estimate = estimate_prior(torch.from_numpy(0.5 * f), torch.from_numpy(s.astype(np.float32)))
    true_prior = float(y.mean())
    assert estimate.prior == pytest.approx(true_prior, abs=0.03)
    assert estimate.label_frequency == pytest.approx(0.5, abs=0.03)
    unlabelled = float(y[~s].mean())
    assert estimate.unlabelled_prior == pytest.approx(unlabelled, abs=0.03)
    # Elkan and Noto's mean over all labelled examples: biased by the overlap (the mean of
    # P(pos | x) over positives, here 0.2 / 0.4 * 1 + 0.2 / 0.4 * 0.25 = 0.625)
    assert estimate.elkan_noto_c == pytest.approx(0.5 * 0.625, abs=0.01)


def _planted_store(n: int, seed: int) -> tuple[ColumnStore, float]:
    """One categorical feature of 20 ids: ids 0-3 always positive, the rest with 0.25
    (prior 0.4); half of the positives labelled. Train and validation splits."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 20, n)
    y = rng.random(n) < np.where(ids < 4, 1.0, 0.25)
    s = (y & (rng.random(n) < 0.5)).astype(np.float32)
    dense = rng.normal(size=(n, 1)).astype(np.float32)
    sparse = ids.reshape(-1, 1).astype(np.int32)
    cut = n * 3 // 4
    splits = {
        "train": [SplitColumns.from_arrays(s[:cut], dense[:cut], sparse[:cut])],
        "validation": [SplitColumns.from_arrays(s[cut:], dense[cut:], sparse[cut:])],
    }
    schema = DataSchema(num_dense=1, sparse=(SparseFeature("item", 20),))
    return ColumnStore(schema, ["item"], [], splits), float(y[:cut].mean())


def test_a_planted_prior_is_recovered_by_a_trained_classifier():
    """The whole estimator (cross-fitted DLRM classifier, then ``estimate_prior``) on
    planted PU data: 48,000 training rows, 960 in the top 2 %, so the estimate's standard
    deviation is about 0.013; the tolerance 0.06 is more than four of them."""
    store, true_prior = _planted_store(64_000, seed=3)
    config = load_config(
        None,
        [
            "data.source=movielens",  # replaced by the planted source below
            "model.embedding_dim=4",
            "model.bottom_mlp=[4]",
            "model.top_mlp=[8, 1]",
            "embedding.lr=0.1",
            "optimizer.warmup_steps=5",
            "train.steps=150",
            "train.batch_size=512",
            "train.threads=1",
            "train.progress=false",
        ],
    )
    estimate = estimate_class_prior(config, folds=2, source=ColumnSource(store))
    assert estimate.prior == pytest.approx(true_prior, abs=0.06)


def test_the_estimator_fits_one_pass_per_fold_when_the_run_would_converge(monkeypatch):
    """Unset train.steps and train.epochs make a run on real data train to convergence
    with early stopping; the folds' fits have none, so each trains one pass."""
    from towerrec.workflows.pu import prior

    fitted = []
    monkeypatch.setattr(
        prior, "fit_steps", lambda model, opt, config, b, steps, d: fitted.append(steps)
    )
    store, _ = _planted_store(8_000, seed=0)
    config = load_config(
        None, ["data.source=movielens", "train.batch_size=1000", "train.threads=1"]
    )
    estimate_class_prior(config, folds=2, source=ColumnSource(store))
    assert fitted == [6, 6]  # one pass over the 6,000 training rows at 1,000 a step, not 20


@pytest.mark.parametrize(
    "labels, message",
    [
        ([0.0, 0.0, 0.0], "no labelled positives"),
        ([1.0, 1.0, 1.0], "no label 0"),
        ([1.0, 0.5, 0.0], "must be 1 \\(labelled positive\\) or 0"),
    ],
)
def test_prior_estimation_refuses_unusable_labels(labels, message):
    with pytest.raises(ValueError, match=message):
        estimate_prior(torch.tensor([0.2, 0.5, 0.9]), torch.tensor(labels))


# ------------------------------------------------------------------ the MovieLens PU view
def test_hiding_positives_keeps_negatives_and_the_tail():
    labels = np.array([1, 1, 0, 1, 1, 0, 1, 1], dtype=np.float32)
    hidden = hide_positives(labels, 6, 0.5, seed=1)
    assert (hidden <= labels).all()  # only positives change, and only to 0
    assert np.array_equal(hidden[6:], labels[6:])  # rows past ``end`` (the test split) kept
    assert np.array_equal(hide_positives(labels, 6, 0.5, seed=1), hidden)  # seeded


def test_the_movielens_pu_view_hides_half_the_train_positives_and_keeps_test_true():
    truth = load_movielens("datasets/ml-latest-small", MovieLensConfig(test_fraction=0.2))
    pu = load_movielens(
        "datasets/ml-latest-small", MovieLensConfig(test_fraction=0.2, pu_hide_fraction=0.5)
    )
    y, s = truth.splits["train"][0].labels, pu.splits["train"][0].labels
    assert (s <= y).all()
    # 29,000 train positives: the hidden share's standard deviation is 0.003
    assert s.sum() / y.sum() == pytest.approx(0.5, abs=0.02)
    assert np.array_equal(truth.splits["test"][0].labels, pu.splits["test"][0].labels)


# ------------------------------------------------------------------ end to end
PU_TRAIN = [
    "data.movielens.pu_hide_fraction=0.5",
    "data.movielens.test_fraction=0.2",
    "loss.kind=pu_bce",
    "loss.class_prior=0.32",
    "train.steps=4",
    "train.eval_every=0",
    "train.progress=false",
    "train.eval_batch_size=4096",
]


def test_towerrec_train_with_pu_bce_on_movielens(tmp_path):
    sets = [x for s in PU_TRAIN for x in ("--set", s)]
    result = run_cli("train", "--config", "configs/movielens.toml", "--out", str(tmp_path), *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] and summary["test"]["eval_samples"] > 0


def test_pu_bce_takes_other_steps_than_bce(tmp_path):
    bce = [s for s in PU_TRAIN if not s.startswith("loss.")]
    one = trainer.train(load_config("configs/movielens.toml", PU_TRAIN), tmp_path / "pu")
    two = trainer.train(load_config("configs/movielens.toml", bce), tmp_path / "bce")
    assert one["test"]["calibration"] > two["test"]["calibration"]  # unlabelled pulled up


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pu_bce_on_2_ranks_follows_one_process(tmp_path):
    sets = [x for s in PU_TRAIN for x in ("--set", s)]
    result = run_cli(
        "train", "--config", "configs/movielens.toml", "--nproc", "2",
        "--out", str(tmp_path / "two"), *sets, OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    one = trainer.train(load_config("configs/movielens.toml", PU_TRAIN), tmp_path / "one")
    assert two["completed"] and one["completed"]
    assert abs(two["auc"] - one["auc"]) < 1e-3
    assert abs(two["logloss"] - one["logloss"]) < 1e-3
    assert abs(two["test"]["logloss"] - one["test"]["logloss"]) < 1e-3


def test_pu_prior_command_prints_the_estimate_and_refuses_a_bad_path(tmp_path):
    result = run_cli("data", "pu-prior", str(tmp_path / "nowhere"))
    assert result.returncode != 0
    assert "neither a config file, a recipe (" in result.stderr
    result = run_cli(
        "data", "pu-prior", "configs/movielens.toml",
        "--set", "data.movielens.pu_hide_fraction=0.5", "--set", "train.steps=3",
        "--set", "optimizer.warmup_steps=1", "--set", "train.progress=false", "--folds", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    estimate = json.loads(result.stdout)
    assert 0 < estimate["unlabelled_prior"] < 1
    assert estimate["held_out"] > 0


def test_an_estimated_prior_trains_on_a_criteo_format_cache(tmp_path):
    from towerrec.data.criteo import CriteoOptions, preprocess_criteo
    from towerrec.data.criteo_gen import generate_criteo_files

    days = generate_criteo_files(tmp_path / "raw", files=2, rows_per_file=801, seed=3)
    cache = tmp_path / "cache"
    options = CriteoOptions(num_embeddings=(500,), eval_files=("day_1",))
    preprocess_criteo(days, cache, options, progress=False)
    config = load_config(
        None,
        [
            "data.source=criteo",
            f"data.path={cache}",
            "loss.kind=pu_bce",
            "loss.class_prior=estimate",
            "model.embedding_dim=8",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "optimizer.warmup_steps=2",
            "train.batch_size=128",
            "train.steps=4",
            "train.threads=1",
            "train.progress=false",
        ],
    )
    summary = trainer.train(config, tmp_path / "run")
    estimate = summary["class_prior_estimate"]
    assert summary["completed"] and 0 < estimate["unlabelled_prior"] < 1
    assert estimate["held_out"] == 801  # every training row scored once, out of fold


def test_towerrec_train_with_punce_on_movielens(tmp_path):
    sets = [s for s in PU_TRAIN if s != "loss.kind=pu_bce"] + ["loss.kind=punce"]
    summary = trainer.train(load_config("configs/movielens.toml", sets), tmp_path)
    pointwise = trainer.train(load_config("configs/movielens.toml", PU_TRAIN), tmp_path / "pu")
    # the contrastive term changes the steps (pu_bce alone is the same run without it)
    assert summary["completed"] and summary["test"]["logloss"] != pointwise["test"]["logloss"]


def test_a_stream_is_scored_on_its_validation_set():
    """The synthetic stream has no rows to deal into folds: one classifier trained on the
    stream scores the validation set (drawn from the same distribution)."""
    config = load_config(
        None,
        [
            "data.synthetic.eval_samples=5000",
            "train.steps=5",
            "train.batch_size=256",
            "train.threads=1",
            "train.progress=false",
        ],
    )
    estimate = estimate_class_prior(config)
    assert estimate.held_out == 5000
    assert estimate.top == 100  # 2 % of the validation set, one group
    assert 0 < estimate.labelled_fraction < estimate.prior < 1
