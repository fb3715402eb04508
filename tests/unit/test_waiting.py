"""``poll_until``: returns what the predicate found, fails naming what it waited for and for how long."""

from __future__ import annotations

import itertools

import pytest

from p2p_diloco.core.waiting import WaitTimeout, poll_until


def test_returns_the_first_truthy_answer() -> None:
    answers = iter([None, 0, [], "found", "later"])
    assert poll_until(lambda: next(answers), 5.0, "the third look", interval_s=0.001) == "found"


def test_a_timeout_names_what_and_the_seconds_and_the_detail() -> None:
    looks = itertools.count()
    with pytest.raises(WaitTimeout) as caught:
        poll_until(lambda: next(looks) < 0, 0.05, "a thing that never happens", interval_s=0.01,
                   detail=lambda: "what was seen instead")
    assert str(caught.value).startswith("a thing that never happens: not within 0.05 s\nwhat was seen instead")
    assert caught.value.what == "a thing that never happens" and caught.value.timeout_s == 0.05
    assert next(looks) >= 2  # asked more than once, and once more at the deadline
    assert isinstance(caught.value, RuntimeError)  # what the launcher's waits raised before


def test_a_predicate_gives_up_early_by_raising() -> None:
    def exited() -> bool:
        raise ChildProcessError("the process exited")

    with pytest.raises(ChildProcessError):
        poll_until(exited, 60.0, "a line")


def test_the_nap_is_pluggable_and_a_zero_timeout_looks_once() -> None:
    naps: list[float] = []
    with pytest.raises(WaitTimeout):
        poll_until(lambda: False, 0.0, "nothing", nap=naps.append)
    assert naps == []
    with pytest.raises(ValueError, match="interval_s"):
        poll_until(lambda: True, 1.0, "bad interval", interval_s=0)
