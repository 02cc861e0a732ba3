"""Scaling-law fits recover planted curves, with intervals that cover them, and refuse
what cannot be fitted."""

import math

import numpy as np
import pytest

from towerrec.scaling import fit_power_law, fit_relative, plot_fits

PLANTED = {"alpha": 2.0, "beta": 0.35, "gamma": 0.42}


def _curve(x, alpha, beta, gamma):
    return alpha * np.power(x, -beta) + gamma


def test_an_exact_power_law_is_recovered():
    x = np.geomspace(1e3, 1e7, 9)
    fit = fit_power_law(x, _curve(x, **PLANTED), bootstrap=0)
    assert fit.alpha == pytest.approx(PLANTED["alpha"], rel=1e-4)
    assert fit.beta == pytest.approx(PLANTED["beta"], rel=1e-4)
    assert fit.gamma == pytest.approx(PLANTED["gamma"], rel=1e-4)
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noisy_power_law_is_recovered_within_5_percent_with_intervals(seed):
    x = np.geomspace(1e2, 1e6, 14)
    rng = np.random.default_rng(seed)
    y = _curve(x, **PLANTED) * (1 + 2e-4 * rng.standard_normal(len(x)))
    fit = fit_power_law(x, y, bootstrap=300, seed=seed)
    for name, value in PLANTED.items():
        assert getattr(fit, name) == pytest.approx(value, rel=0.05), name
        lo, hi = fit.intervals[name]  # a 95% interval: around the estimate, near the truth
        assert lo <= getattr(fit, name) <= hi and hi - lo < 0.1 * value, (name, lo, hi)
        assert lo - (hi - lo) <= value <= hi + (hi - lo), (name, lo, hi)
    assert fit.r2 > 0.99


def test_units_of_x_do_not_matter():
    x = np.geomspace(1.0, 1e4, 8)
    y = _curve(x, **PLANTED)
    a, b = fit_power_law(x, y, bootstrap=0), fit_power_law(x * 1e9, y, bootstrap=0)
    assert b.beta == pytest.approx(a.beta, rel=1e-6)
    assert b.gamma == pytest.approx(a.gamma, rel=1e-6)
    assert b.alpha == pytest.approx(a.alpha * 1e9**a.beta, rel=1e-5)


def test_the_relative_form_gives_the_improvement_per_quadrupling():
    compute = np.array([1.0, 4.0, 16.0, 64.0, 256.0])
    baseline = 0.5
    improvement = 0.3 + 0.1 * np.log(compute) / math.log(4)  # percent
    logloss = baseline * (1 - improvement / 100)
    fit = fit_relative(compute, logloss, baseline)
    assert fit.per_quadrupling == pytest.approx(0.1, rel=1e-9)
    assert fit.intercept == pytest.approx(0.3, rel=1e-9)


@pytest.mark.parametrize(
    "x, y, message",
    [
        ([1, 2, 3], [1.0, 0.9, 0.8], "too few points to fit"),
        ([1, 1, 1, 1, 1], [1.0, 0.9, 0.8, 0.7, 0.6], "too few points"),
        ([0, 1, 2, 3, 4], [1.0, 0.9, 0.8, 0.7, 0.6], "x must be > 0"),
        ([1, 2, 3, 4], [1.0, float("nan"), 0.8, 0.7], "finite"),
        ([1, 2, 3, 4], [1.0, 0.9], "one length"),
    ],
)
def test_what_cannot_be_fitted_is_refused(x, y, message):
    with pytest.raises(ValueError, match=message):
        fit_power_law(x, y, bootstrap=0)


def test_a_plot_is_written(tmp_path):
    x = np.geomspace(1e3, 1e6, 6)
    y = _curve(x, **PLANTED)
    fit = fit_power_law(x, y, bootstrap=0)
    path = tmp_path / "fit.png"
    plot_fits({"planted": (x, y, fit)}, str(path), "examples")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
