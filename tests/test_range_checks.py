"""The range checks every config dataclass runs (towerrec.utils): one message shape."""

import math

import pytest

from towerrec.utils import above, at_least, positive, within


def test_a_value_in_range_passes_and_unset_is_not_checked():
    at_least("a.b", 1, 1)
    at_least("a.b", None, 1)
    above("a.b", 1.5, 1)
    positive("a.b", 1e-12)
    within("a.b", 0.0, "[0, 1)")
    within("a.b", 1.0, "(0, 1]")


@pytest.mark.parametrize(
    "check, message",
    [
        (lambda: at_least("train.batch_size", 0, 1), "train.batch_size must be >= 1, got 0"),
        (lambda: positive("optimizer.lr", 0.0), "optimizer.lr must be > 0, got 0.0"),
        (lambda: above("x.growth", 1, 1, hint="e.g. 2"), "x.growth must be > 1 (e.g. 2), got 1"),
        (
            lambda: positive("x.poll_s", -1, unit="seconds"),
            "x.poll_s must be > 0 seconds, got -1",
        ),
        (lambda: within("x.p", 1, "(0, 1)"), "x.p must lie in (0, 1), got 1"),
        (lambda: within("x.p", -0.5, "[0, 1]"), "x.p must lie in [0, 1], got -0.5"),
        (
            lambda: at_least("x.a and b", (1, 0), 1, hint="0: off"),
            "x.a and b must be >= 1 (0: off), got 1 and 0",
        ),
        (lambda: at_least("x.n", math.nan, 0), "x.n must be >= 0, got nan"),
    ],
)
def test_a_value_out_of_range_is_named_with_the_bound(check, message):
    with pytest.raises(ValueError) as e:
        check()
    assert str(e.value) == message


def test_the_interval_ends_are_open_or_closed_as_written():
    for interval, inside, outside in [
        ("(0, 1)", [0.5], [0, 1]),
        ("[0, 1)", [0, 0.5], [1]),
        ("(0, 1]", [0.5, 1], [0]),
        ("[0, 1]", [0, 1], [1.01, -0.01]),
    ]:
        for v in inside:
            within("k", v, interval)
        for v in outside:
            with pytest.raises(ValueError, match=r"k must lie in"):
                within("k", v, interval)
