import math

import numpy as np
import pytest
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from towerrec.train.metrics import auc, calibration, compute_metrics, log_loss, normalized_entropy


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = 5000
    labels = rng.random(n) < 0.3
    # Coarse scores: many exact ties, correlated with the labels.
    scores = np.round(rng.random(n) * 0.6 + labels * 0.3, 2)
    assert len(np.unique(scores)) < 100  # ties really present
    assert abs(auc(scores, labels) - roc_auc_score(labels, scores)) < 1e-6


def test_auc_all_tied_and_single_class():
    assert auc(np.full(10, 0.5), np.array([0, 1] * 5)) == pytest.approx(0.5)
    assert math.isnan(auc(np.random.rand(10), np.ones(10)))


def test_logloss_ne_calibration_against_oracles():
    rng = np.random.default_rng(0)
    probs = rng.uniform(0.01, 0.99, 2000)
    labels = (rng.random(2000) < probs).astype(float)
    assert log_loss(probs, labels) == pytest.approx(sk_log_loss(labels, probs), rel=1e-9)
    rate = labels.mean()
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert normalized_entropy(probs, labels) == pytest.approx(sk_log_loss(labels, probs) / entropy)
    # Predicting the base rate everywhere has NE exactly 1.
    assert normalized_entropy(np.full(2000, rate), labels) == pytest.approx(1.0)
    assert calibration(probs, labels) == pytest.approx(probs.sum() / labels.sum())
    m = compute_metrics(probs, labels)
    assert m.samples == 2000 and m.auc == pytest.approx(roc_auc_score(labels, probs))


def test_metric_input_errors():
    with pytest.raises(ValueError, match="2 predictions but 3 labels"):
        auc([0.1, 0.2], [0, 1, 1])
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        log_loss([0.1, 0.2], [0, 2])
