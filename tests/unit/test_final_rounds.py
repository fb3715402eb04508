"""A leaving learner's final rounds (:func:`p2p_diloco.engine.rounds.final_rounds`) on a stand-in for its rounds:
each waits for its fragment's next boundary on the clock as it is *then*, so a retune adopted meanwhile moves it."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace
from typing import Any

from p2p_diloco.engine.rounds import FINAL_WAIT_LOOK_S, final_rounds
from p2p_diloco.net.clock import SyncClock

DEADLINE_S = 30.0
"""Generous: the waits below are a few seconds."""


def _rounds(clock: SyncClock, handed: list[tuple[int, float]], now: Any,
            last_round_at: float = -math.inf, fragments: int = 1) -> SimpleNamespace:
    slots = [SimpleNamespace(index=i, since_steps=5, last_round_at=last_round_at) for i in range(fragments)]
    return SimpleNamespace(
        final_rounds_in_turn=lambda: False, view=SimpleNamespace(clock=clock),
        cfg=SimpleNamespace(averaging=SimpleNamespace(clock_groups=True)), dht_time=now, window_s=0.5,
        syncs=[SimpleNamespace(slot=slot) for slot in slots], drain=lambda step: None,
        hand_off=lambda sync, step, final=False: handed.append((sync.slot.index, now())))


def test_a_final_round_follows_a_retune_adopted_while_it_waits() -> None:
    t0 = time.monotonic()

    def now() -> float:
        return 1000.0 + time.monotonic() - t0

    old = SyncClock(period_s=100.0, origin=1000.0 - 5.0)  # fragment 0's next boundary 95 s ahead
    handed: list[tuple[int, float]] = []
    rounds = _rounds(old, handed, now)
    worker = threading.Thread(target=final_rounds, args=(rounds, 7, threading.Event()))
    worker.start()
    time.sleep(FINAL_WAIT_LOOK_S / 2)
    assert not handed  # waiting for the old clock's boundary
    # the status thread adopts a retune: a boundary 2 s ahead
    rounds.view.clock = SyncClock(period_s=10.0, origin=now() + 2.0 - 10.0, epoch=1)
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    assert len(handed) == 1 and handed[0][0] == 0
    assert handed[0][1] - 1000.0 < 2.0 + 2 * FINAL_WAIT_LOOK_S  # at the new boundary, not 95 s later


def test_a_final_round_is_handed_off_at_once_within_its_open_window() -> None:
    t0 = time.monotonic()

    def now() -> float:
        return 1000.0 + time.monotonic() - t0

    handed: list[tuple[int, float]] = []
    final_rounds(_rounds(SyncClock(period_s=100.0, origin=1000.0 - 100.0 - 0.1), handed, now), 7, threading.Event())
    assert len(handed) == 1 and handed[0][1] - 1000.0 < 0.5  # the boundary 0.1 s ago: its group is still open


def test_a_final_round_does_not_go_to_the_boundary_whose_round_we_were_in() -> None:
    """Our time ran out just after our round at a boundary: that boundary's group is over for us (the others are not
    coming to it again), so the final round waits for the next boundary, where the others' final rounds go too."""
    t0 = time.monotonic()

    def now() -> float:
        return 1000.0 + time.monotonic() - t0

    clock = SyncClock(period_s=2.0, origin=1000.0 - 2.0 - 0.1)  # a boundary 0.1 s ago, the next one 1.9 s ahead
    handed: list[tuple[int, float]] = []
    final_rounds(_rounds(clock, handed, now, last_round_at=1000.0 - 0.05), 7, threading.Event())
    assert len(handed) == 1 and 1.9 - 0.1 <= handed[0][1] - 1000.0 < 1.9 + 2 * FINAL_WAIT_LOOK_S


def test_a_final_round_whose_boundary_comes_after_the_wait_is_skipped() -> None:
    """A slow link's long period: of two fragments, the one whose boundary comes within the wait for final rounds
    (``SyncOptions.final_wait_s`` after training ended) goes there; the other, its boundary past the wait, is skipped,
    and the leaving learner does not wait for it."""
    t0 = time.monotonic()

    def now() -> float:
        return 1000.0 + time.monotonic() - t0

    # 2 fragments on a 40 s period: fragment 1's boundary 1 s ahead, fragment 0's 21 s ahead
    clock = SyncClock(period_s=40.0, origin=1000.0 + 1.0 - 20.0 - 40.0)
    handed: list[tuple[int, float]] = []
    rounds = _rounds(clock, handed, now, fragments=2)
    final_rounds(rounds, 7, threading.Event(), wait_until=time.monotonic() + 10.0)
    took_s = time.monotonic() - t0
    assert [f for f, _ in handed] == [1], handed
    assert 1.0 - 0.1 <= handed[0][1] - 1000.0 < 1.0 + 2 * FINAL_WAIT_LOOK_S
    assert took_s < 10.0, f"waited {took_s:.1f} s for a boundary past the wait"


def test_without_a_wait_for_them_every_final_round_waits_for_its_boundary() -> None:
    """The same two fragments, the wait long enough for both: both go, each at its boundary."""
    t0 = time.monotonic()

    def now() -> float:
        return 1000.0 + time.monotonic() - t0

    clock = SyncClock(period_s=4.0, origin=1000.0 + 1.0 - 2.0 - 4.0)  # fragment 1's boundary 1 s ahead, fragment 0's 3 s
    handed: list[tuple[int, float]] = []
    rounds = _rounds(clock, handed, now, fragments=2)
    final_rounds(rounds, 7, threading.Event(), wait_until=time.monotonic() + 10.0)
    assert [f for f, _ in handed] == [1, 0], handed
    assert 3.0 - 0.1 <= handed[1][1] - 1000.0 < 3.0 + 2 * FINAL_WAIT_LOOK_S


def test_a_boundary_that_passed_during_an_earlier_final_round_past_the_wait_is_skipped() -> None:
    """Final rounds in turn (a slow link): fragment 1's round runs past fragment 0's boundary, which comes after the
    wait for final rounds. Its group is still open when fragment 1's round ends, but the boundary is past the wait:
    fragment 0 is skipped, not handed off late (at 0.25 Mbit/s such a last round held a learner 65 s past its limit)."""
    t0 = time.monotonic()

    def now() -> float:
        return 1000.0 + time.monotonic() - t0

    clock = SyncClock(period_s=4.0, origin=1000.0 + 0.5 - 2.0 - 4.0)  # fragment 1's boundary 0.5 s ahead, fragment 0's 2.5
    handed: list[tuple[int, float]] = []
    rounds = _rounds(clock, handed, now, fragments=2)
    rounds.final_rounds_in_turn = lambda: True
    rounds.window_s = 1.0
    # fragment 1's round ends 2.8 s in: fragment 0's boundary passed 0.3 s before, its group open (a 1 s window)
    rounds.drain = lambda step: time.sleep(max(0.0, 2.8 - (time.monotonic() - t0)))
    final_rounds(rounds, 7, threading.Event(), wait_until=t0 + 2.0)
    assert [f for f, _ in handed] == [1], handed
