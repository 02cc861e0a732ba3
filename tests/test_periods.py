"""Periods of time-ordered data: every row once, in time order; drift and id turnover."""

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from towerrec.data.cache import open_cache
from towerrec.data.criteo import CriteoOptions, preprocess_criteo
from towerrec.data.criteo_gen import generate_criteo_files
from towerrec.data.movielens import (
    MovieLensConfig,
    bundled_movielens_path,
    load_movielens,
    movielens_periods,
)
from towerrec.data.periods import PeriodSource, cache_periods, period_rank_batches
from towerrec.data.synthetic import SyntheticConfig, SyntheticSource
from towerrec.train.metrics import auc

SMALL = dict(num_embeddings=(50, 80, 200), pooling_factors=(1, 1, 2), num_dense=4)


def cat(batches):
    """Labels, dense features and each feature's ids of ``batches`` joined in order."""
    batches = list(batches)
    ids = {
        key: torch.cat([b.sparse.to_dict()[key].values for b in batches]).numpy()
        for key in batches[0].sparse.to_dict()
    }
    return (
        torch.cat([b.labels for b in batches]).numpy(),
        torch.cat([b.dense for b in batches]).numpy(),
        ids,
    )


def assert_same(a, b):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for key in a[2]:
        np.testing.assert_array_equal(a[2][key], b[2][key])


def test_rank_batches_cover_each_row_once_with_equal_batch_counts():
    for rows, batch, world in [(10, 3, 1), (10, 3, 2), (7, 4, 3), (1, 5, 2), (25, 4, 2)]:
        shares = [list(period_rank_batches(rows, batch, r, world)) for r in range(world)]
        assert len({len(s) for s in shares}) == 1  # the same number of batches on every rank
        covered = sorted(i for s in shares for lo, hi in s for i in range(lo, hi))
        assert covered == list(range(rows))
    # Full batches give every rank its B rows, as the training stream does.
    assert list(period_rank_batches(8, 2, 1, 2)) == [(2, 4), (6, 8)]


def test_synthetic_periods_are_the_stationary_stream_in_order():
    plain = SyntheticSource(SyntheticConfig(**SMALL))
    periods = SyntheticSource(SyntheticConfig(**SMALL, periods=3, period_samples=1000))
    assert periods.num_periods == 3
    joined = [b for p in range(3) for b in periods.period_batches(p, 300)]
    assert_same(cat(joined), cat([plain.samples("train", 0, 3000)[0]]))
    # Without drift every period's teacher is period 0's: the same probabilities.
    for p in range(3):
        labels, probs = periods.period_oracle(p)
        batch, expected = plain.samples("train", p * 1000, 1000)
        np.testing.assert_array_equal(probs, expected)
        np.testing.assert_array_equal(labels, batch.labels.numpy())


def test_one_period_is_bit_identical_to_the_plain_stream():
    plain = SyntheticSource(SyntheticConfig(**SMALL))
    one = SyntheticSource(SyntheticConfig(**SMALL, periods=1))
    assert_same(
        cat([one.samples("train", 5000, 3000)[0]]), cat([plain.samples("train", 5000, 3000)[0]])
    )
    np.testing.assert_array_equal(one.eval_oracle()[1], plain.eval_oracle()[1])


def test_drift_moves_the_teacher_and_turnover_brings_new_ids():
    cfg = dict(**SMALL, periods=3, period_samples=4096)
    plain = SyntheticSource(SyntheticConfig(**cfg))
    drifting = SyntheticSource(SyntheticConfig(**cfg, drift=0.5))
    # Same draws of the features, other labels: the teacher moved.
    p0 = plain.samples("train", 4096, 4096, period=1)
    p1 = drifting.samples("train", 4096, 4096, period=1)
    np.testing.assert_array_equal(p0[0].dense.numpy(), p1[0].dense.numpy())
    assert np.abs(p0[1] - p1[1]).mean() > 0.05
    # Period 0 is untouched by drift.
    np.testing.assert_array_equal(plain.period_oracle(0)[1], drifting.period_oracle(0)[1])

    turning = SyntheticSource(SyntheticConfig(**cfg, id_turnover=0.25))
    rows = SMALL["num_embeddings"][2]
    active = int(rows / (1 + 2 * 0.25))
    seen = [set(cat(turning.period_batches(p, 4096))[2]["cat_2"].tolist()) for p in range(3)]
    actives = [set(turning._period_teacher(p).perms[2].tolist()) for p in range(3)]
    assert all(len(a) == active for a in actives)
    assert all(s <= a for s, a in zip(seen, actives))  # only active ids are drawn
    assert all(max(s) < rows for s in seen)
    assert len(actives[1] - actives[0]) == len(actives[2] - actives[1]) == int(0.25 * active)
    assert not (actives[2] - actives[1]) & actives[0]  # a retired id never comes back
    assert len(seen[1] - seen[0]) > 0.5 * int(0.25 * active)  # fresh ids show up at once


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(periods=-1), "periods must be >= 0"),
        (dict(periods=3, drift=1.5), "drift must lie in"),
        (dict(periods=3, id_turnover=1.0), "id_turnover must lie in"),
        (dict(periods=3, drift_mode="linear"), "drift_mode = .linear. is not one of"),
        (dict(periods=3, period_samples=0), "period_samples must be >= 1"),
        (dict(num_embeddings=(3,), pooling_factors=(), periods=50, id_turnover=0.5), "at least"),
    ],
)
def test_synthetic_period_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**kwargs)


def test_period_out_of_range_is_refused():
    source = SyntheticSource(SyntheticConfig(**SMALL, periods=2, period_samples=100))
    with pytest.raises(ValueError, match="period 2 is not in"):
        list(source.period_batches(2, 10))


@pytest.fixture(scope="module")
def movielens():
    return load_movielens(bundled_movielens_path())


@pytest.mark.parametrize("period_by", ["count", "calendar"])
def test_movielens_periods_are_every_rating_in_time_order(movielens, period_by):
    periods = movielens_periods(
        bundled_movielens_path(), MovieLensConfig(periods=5, period_by=period_by)
    )
    rows = [periods.period_rows(p) for p in range(5)]
    total = sum(movielens.rows(s) for s in ("train", "validation", "test"))
    assert sum(rows) == total
    if period_by == "count":
        assert max(rows) - min(rows) <= 1
    else:
        assert max(rows) - min(rows) > 1000  # calendar spans hold unequal counts
    labels = np.concatenate([cat(periods.period_batches(p, 8192))[0] for p in range(5)])
    expected = np.concatenate(
        [p.labels for s in ("train", "validation", "test") for p in movielens.splits[s]]
    )
    np.testing.assert_array_equal(labels, expected)


def write_movielens(path: Path, stamps):
    path.mkdir()
    (path / "movies.csv").write_text("movieId,title,genres\n1,A (1999),Comedy\n")
    (path / "tags.csv").write_text("userId,movieId,tag,timestamp\n")
    lines = "".join(f"1,1,{4 + i % 2},{t}\n" for i, t in enumerate(stamps))
    (path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + lines)
    return path


def test_movielens_period_errors(tmp_path):
    small = write_movielens(tmp_path / "small", [1, 2, 3, 100])
    with pytest.raises(ValueError, match="only 4 rows; use at most 4"):
        movielens_periods(small, MovieLensConfig(periods=5))
    # A calendar quarter without ratings (between 3 and 100) is an empty period.
    with pytest.raises(ValueError, match=r"period 1 .* has no ratings"):
        movielens_periods(small, MovieLensConfig(periods=4, period_by="calendar"))
    with pytest.raises(ValueError, match="period_by must be"):
        MovieLensConfig(periods=2, period_by="week")


@pytest.fixture(scope="module")
def day_files(tmp_path_factory):
    return generate_criteo_files(tmp_path_factory.mktemp("days"), 3, 700, seed=3)


def convert(files, out, **options):
    preprocess_criteo(files, out, CriteoOptions(num_embeddings=(1000,), **options), progress=False)
    return open_cache(out)


def test_criteo_day_files_are_periods_in_order(day_files, tmp_path):
    periods = cache_periods(convert(day_files, tmp_path / "cache"))
    assert periods.num_periods == 3
    for p, day in enumerate(day_files):
        alone = cache_periods(convert([day], tmp_path / f"one_{p}"))
        assert periods.period_rows(p) == 700
        assert_same(cat(periods.period_batches(p, 256)), cat(alone.period_batches(0, 256)))


def test_criteo_period_errors(day_files, tmp_path):
    with pytest.raises(ValueError, match=r"out of order: 'day_1' .* after 'day_2'"):
        cache_periods(convert([day_files[0], day_files[2], day_files[1]], tmp_path / "a"))
    with pytest.raises(ValueError, match="has no training rows"):
        cache_periods(convert(day_files, tmp_path / "b", eval_files=(day_files[2].name,)))


def test_every_period_source_declares_the_protocol(day_files, tmp_path):
    synthetic = SyntheticSource(SyntheticConfig(**SMALL, periods=2, period_samples=10))
    movielens = movielens_periods(bundled_movielens_path(), MovieLensConfig(periods=2))
    days = cache_periods(convert(day_files, tmp_path / "cache"))
    for source in (synthetic, movielens, days):
        assert isinstance(source, PeriodSource)
    assert synthetic.period_oracle(1)[1].shape == (10,)
    assert movielens.period_oracle(1) is None and days.period_oracle(0) is None


def test_trend_drift_is_deterministic_and_moves_away_period_after_period():
    """drift_mode = "trend" turns the teacher along one direction: period t's teacher
    scores period t+k's labels worse as k grows (its oracle AUC falls), the same config
    draws the same stream, and "random" (the default) is untouched by the new mode."""
    cfg = dict(**SMALL, periods=5, period_samples=4096, drift=0.15, drift_mode="trend")
    trend = SyntheticSource(SyntheticConfig(**cfg))
    again = SyntheticSource(SyntheticConfig(**cfg))
    for p in range(5):
        np.testing.assert_array_equal(trend.period_oracle(p)[1], again.period_oracle(p)[1])
    # Without id turnover every period draws the same features: period 0's teacher
    # (probabilities) against period k's labels on the rows of period k.
    scores = []
    for k in range(5):
        start = k * 4096
        labels = trend.samples("train", start, 4096, period=k)[0].labels.numpy()
        scores.append(auc(trend.samples("train", start, 4096, period=0)[1], labels))
    assert all(a > b + 0.01 for a, b in itertools.pairwise(scores)), scores
    assert not np.array_equal(trend.period_oracle(3)[1], again.period_oracle(2)[1])


def test_random_drift_draws_the_stream_it_drew_before_drift_modes():
    """The default drift_mode ("random"), with id turnover, labels period 3 with the
    probabilities it had before "trend" existed (values recorded from that code; to 1e-12:
    the teacher's scores are summed in another order since, which moves their last bits,
    where another draw would move them by more than 1e-3)."""
    cfg = dict(**SMALL, periods=5, period_samples=4096, drift=0.15, id_turnover=0.1)
    probs = SyntheticSource(SyntheticConfig(**cfg)).period_oracle(3)[1]
    recorded = [0.30842755920127646, 0.6618622415051303, 0.11609156648597373]
    assert probs[:3].tolist() == pytest.approx(recorded, rel=1e-12, abs=0)
    assert float(probs.sum()) == pytest.approx(1370.9357661595932, rel=1e-12, abs=0)
