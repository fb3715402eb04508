"""Wait for an event, not for a time: :func:`poll_until` asks a predicate until it holds or a deadline passes.

Code that waits for something another process does (a line printed, a record published, a process gone)
should say *what* it waits for and how long it is willing to wait, and fail with both when the thing does
not happen. A bare ``time.sleep(4.5)`` says neither: it is too long on a quick machine and too short on a
busy one. Deadlines are ``time.monotonic()`` (a wall-clock step must not end or stretch a wait).

Only the standard library is imported here (the launcher and the CLI's fast paths use it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL_S = 0.2
"""Seconds between two looks: quick enough that a test does not idle, slow enough not to load a busy machine."""


class WaitTimeout(RuntimeError):
    """What was awaited did not happen within the deadline. A ``RuntimeError``, as the launcher's waits raised."""

    def __init__(self, what: str, timeout_s: float, detail: str = "") -> None:
        self.what, self.timeout_s = what, timeout_s
        super().__init__(f"{what}: not within {timeout_s:g} s" + (f"\n{detail}" if detail else ""))


def poll_until(predicate: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = DEFAULT_INTERVAL_S, *,
               detail: Callable[[], str] | None = None, nap: Callable[[float], object] = time.sleep) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    ``timeout_s``: how long to keep asking (monotonic seconds); the predicate is asked once more at the
    deadline, so a wait never fails while the awaited thing already holds. Then :class:`WaitTimeout` names
    ``what`` and the seconds waited, followed by ``detail()`` (e.g. a process's output) if given.
    ``interval_s``: seconds between looks. ``nap(seconds)`` does the waiting between looks: ``time.sleep`` by
    default, or e.g. a ``threading.Condition.wait`` that returns early when there is news.
    A predicate gives up early (a process it waits on exited) by raising."""
    if timeout_s < 0 or interval_s <= 0:
        raise ValueError(f"poll_until({what!r}): timeout_s must be >= 0 and interval_s > 0, "
                         f"got {timeout_s} and {interval_s}")
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise WaitTimeout(what, timeout_s, detail() if detail is not None else "")
        nap(min(interval_s, left_s))
