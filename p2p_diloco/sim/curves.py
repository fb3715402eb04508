"""Reading loss curves: the value at a point, and where a target is first reached.

A curve is a sequence of ``(x, loss)`` pairs: x is tokens, steps or seconds. Pure functions, used by
the benchmarks (``scripts/wan/bench_wan.py``, ``scripts/bench_hetero.py``) to compare runs at equal
tokens and to find a time to a target loss.
"""

from __future__ import annotations

from typing import Sequence


def value_at(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """The curve's value at ``x``, linear between its points (sorted by x here); None outside them."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1] if pts[0][0] == x else None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def crossing(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The x at which the curve (x increasing) first reaches ``target`` or below, linear between the last
    point above it and the first at or below it; None if it never does."""
    prev: tuple[float, float] | None = None
    for x, loss in points:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return x
            return prev[0] + (prev[1] - target) / (prev[1] - loss) * (x - prev[0])
        prev = (x, loss)
    return None
