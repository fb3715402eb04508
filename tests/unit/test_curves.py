"""Reading loss curves (pure): values between points, and the first crossing of a target."""

from __future__ import annotations

import pytest

from p2p_diloco.sim.curves import crossing, value_at

PTS = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]


def test_crossing_is_linear_between_the_points_around_the_target() -> None:
    assert crossing(PTS, 2.5) == pytest.approx(15.0)
    assert crossing(PTS, 3.0) == 10.0  # reached exactly at a point
    assert crossing(PTS, 6.0) == 0.0  # already below at the start
    assert crossing([(0.0, 2.0), (5.0, 2.0), (9.0, 1.0)], 2.0) == 0.0


def test_crossing_is_none_when_the_target_is_never_reached() -> None:
    assert crossing(PTS, 1.0) is None
    assert crossing([], 1.0) is None


def test_value_at_is_linear_inside_the_curve_and_none_outside() -> None:
    assert value_at(PTS, 25.0) == pytest.approx(1.75)
    assert value_at(list(reversed(PTS)), 5.0) == pytest.approx(4.0)  # order of the points does not matter
    assert value_at(PTS, 31.0) is None and value_at(PTS, -1.0) is None
    assert value_at([(3.0, 2.0)], 3.0) == 2.0 and value_at([(3.0, 2.0)], 4.0) is None
    assert value_at([], 0.0) is None
