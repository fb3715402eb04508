"""The fault-injection spec (pure): parsing, one-line errors, and which hit fires."""

from __future__ import annotations

from typing import Any

import pytest

from p2p_diloco.core import faults


def test_parse_fault_specs() -> None:
    f = faults.parse_fault("kill@while-reducing:fragment=0:at=2")
    assert (f.action, f.point, f.fragment, f.at) == ("kill", "while-reducing", 0, 2)
    assert faults.parse_fault(f.spec) == f
    s = faults.parse_fault("stall@inner-step:seconds=2.5")
    assert (s.action, s.seconds, s.fragment, s.at) == ("stall", 2.5, None, 1)
    assert faults.parse_fault(s.spec) == s


@pytest.mark.parametrize("spec, words", [
    ("explode@inner-step", "ACTION@POINT"), ("kill@nowhere", "POINT"), ("kill", "ACTION@POINT"),
    ("kill@inner-step:at=0", "at >= 1"), ("kill@inner-step:at=two", "at must be a number"),
    ("kill@inner-step:when=3", "bad option"), ("kill@inner-step:at=1:at=2", "bad option"),
    ("kill@inner-step:seconds=3", "only applies to stall"), ("stall@inner-step:seconds=0", "seconds"),
])
def test_bad_specs_fail_with_one_line(spec: str, words: str) -> None:
    with pytest.raises(ValueError) as e:
        faults.parse_fault(spec)
    assert words in str(e.value) and "\n" not in str(e.value) and spec in str(e.value)


def test_the_nth_hit_of_the_right_fragment_fires(capfd: pytest.CaptureFixture[str]) -> None:
    stall = faults.parse_fault("stall@before-send:fragment=1:at=2:seconds=0.01")
    faults.arm([stall])
    try:
        for fragment in (0, 1, 0, 0):  # only fragment 1's hits count: the first is hit 1
            faults.hit("before-send", fragment)
        faults.hit("inner-step")
        assert "FAULT fired" not in capfd.readouterr().err
        faults.hit("before-send", 1)  # hit 2 of fragment 1: fires (a 10 ms stall)
        assert f"FAULT fired: {stall.spec} (hit 2" in capfd.readouterr().err
        faults.hit("before-send", 1)  # fires once
        assert "FAULT fired" not in capfd.readouterr().err
    finally:
        faults.arm([])
    assert faults.armed() == ()


def test_after_first_hits_once_the_first_item_was_handled(capfd: pytest.CaptureFixture[str]) -> None:
    import asyncio

    async def numbers() -> Any:
        for i in range(3):
            yield i

    async def consume() -> list[tuple[int, bool]]:
        seen = []
        async for i in faults.after_first(numbers(), "serving-state", 2):
            seen.append((i, "FAULT fired" in capfd.readouterr().err))
        return seen

    faults.arm([faults.parse_fault("stall@serving-state:fragment=2:seconds=0.01")])
    try:
        seen = asyncio.run(consume())
    finally:
        faults.arm([])
    # the items pass unchanged; the point is hit after the first one was handled, before the second arrives
    assert seen == [(0, False), (1, True), (2, False)]


def test_raise_fault_raises_in_the_process_that_hits_it() -> None:
    f = faults.parse_fault("raise@inner-step:at=2")
    assert (f.action, f.point, f.at, f.spec) == ("raise", "inner-step", 2, "raise@inner-step:at=2")
    faults.arm([f])
    try:
        faults.hit("inner-step")  # the 1st hit: nothing
        with pytest.raises(faults.FaultInjected, match=r"raise@inner-step:at=2 \(hit 2\)"):
            faults.hit("inner-step")
    finally:
        faults.arm([])
