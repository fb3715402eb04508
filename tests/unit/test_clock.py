"""The swarm's sync clock: boundaries, derivation of the period, leader choice, wire format (pure)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from p2p_diloco.net.clock import (
    SyncClock,
    awaits_links,
    clock_leader,
    derive_period,
    min_period_s,
    needs_retune,
    newest_clock,
    recent_step_time_s,
    retune,
    retune_allowed,
)


def test_learners_of_any_speed_meet_at_the_same_instants() -> None:
    clock, frags = SyncClock(10.0), 2
    fast = [f for t in range(1, 100) for f in clock.due(t - 1 + 0.5, t + 0.5, frags)]
    slow = [f for t in range(1, 34) for f in clock.due(3 * (t - 1) + 0.5, 3 * t + 0.5, frags)]
    # boundaries k >= 1: fragment 0 at 10, 20, ..., 90; fragment 1 at 15, 25, ..., 95
    assert fast.count(0) == slow.count(0) == 9 and fast.count(1) == slow.count(1) == 9
    assert clock.boundary(27.0, 0, frags) == 20.0 and clock.boundary(27.0, 1, frags) == 25.0
    assert clock.due(5.0, 5.0, frags) == [] and clock.due(6.0, 5.0, frags) == []


def test_a_derived_clock_starts_a_full_period_after_its_origin() -> None:
    clock, frags = SyncClock(8.0, origin=1000.0), 4
    assert clock.due(990.0, 1007.9, frags) == []  # nothing due in the first period: progress accumulates
    assert clock.due(1007.9, 1008.0, frags) == [0]
    assert clock.due(1008.0, 1016.0, frags) == [0, 1, 2, 3]  # 1010, 1012, 1014, then 1016
    assert clock.boundary(1003.0, 1, frags) == 1010.0  # before the first boundary: the first one
    assert clock.boundary(1019.0, 1, frags) == 1018.0


def test_period_is_h_times_the_median_step_time() -> None:
    assert derive_period([0.5, 0.6, 3.0], sync_every=25, min_period_s=5.0) == pytest.approx(15.0)  # median 0.6
    assert derive_period([0.1], sync_every=10, min_period_s=6.0) == 6.0  # at least a round's worth


def test_the_period_floor_is_one_rounds_matching_and_verdicts() -> None:
    from p2p_diloco.core.config import AveragingConfig

    a = AveragingConfig()
    floor = min_period_s(a.window_max_s, a.commit_timeout_s)
    assert floor == a.window_max_s + a.commit_timeout_s == 13.0
    # the networked learners of results/learners: H = 28 at 0.46 s a step is a 12.9 s period; the old floor (twice
    # the window's bound, 20 s) made it every 43 steps
    assert derive_period([0.46] * 4, sync_every=28, min_period_s=floor) == 13.0
    assert derive_period([0.5] * 4, sync_every=28, min_period_s=floor) == pytest.approx(14.0)
    assert derive_period([], 10, 1.0) is None and derive_period([0.0, math.nan], 10, 1.0) is None
    # groups from the clock: no floor from the window; fast steps sync at H (0.1 s steps, H = 20: every 2 s), and a
    # slow link stretches the period to fit one sync (LINK_PERIOD_SAFETY x its link time), nothing else
    clock_floor = min_period_s(a.window_max_s, a.commit_timeout_s, clock_groups=True)
    assert clock_floor == 0.0
    assert derive_period([0.1] * 4, sync_every=20, min_period_s=clock_floor) == pytest.approx(2.0)
    assert derive_period([0.1] * 4, sync_every=20, min_period_s=clock_floor, sync_link_s=[10.0]) > 10.0


def test_retune_only_when_the_period_is_off() -> None:
    assert needs_retune(None, 10.0)
    assert not needs_retune(SyncClock(10.0), 12.0) and not needs_retune(SyncClock(10.0), 8.0)
    assert needs_retune(SyncClock(10.0), 13.0) and needs_retune(SyncClock(10.0), 7.0)


def test_a_first_clock_from_the_leader_alone_is_retuned_once_the_others_are_read() -> None:
    first = SyncClock(18.0)  # a slow leader's own steps: 1.8 s x H = 10
    assert retune_allowed(None, 0.0, 1, 0)
    assert retune_allowed(first, 2.0, 3, 1)  # two more learners' step times: at once
    assert retune_allowed(first, 2.0, 4, 3)  # a link measured since (step times and link times count together)
    assert not retune_allowed(first, 2.0, 3, 3) and not retune_allowed(first, 2.0, 2, 3)  # same or fewer: wait
    assert retune_allowed(first, 3 * 18.0, 3, 3)  # ... three periods
    assert not retune_allowed(first, 17.0, 3, 3, longer=True) and retune_allowed(first, 18.0, 3, 3, longer=True)
    # published at 1000 (first boundary 1021), retuned to 5 s at 1002: the first round at 1010, not 1021
    first = retune(None, 18.0, now_s=1000.0, margin_s=3.0, num_fragments=2)
    assert first.next_any_boundary(1000.0, 2) == 1021.0
    second = retune(first, 5.0, now_s=1002.0, margin_s=3.0, num_fragments=2)
    assert second.epoch == 1 and second.next_any_boundary(1002.0, 2) == 1010.0
    assert second.due(1002.0, 1009.9, 2) == [] and second.due(1009.9, 1010.0, 2) == [0]
    assert second.due(1010.0, 1012.5, 2) == [1]


def test_the_step_time_forgets_the_slow_first_steps() -> None:
    # 10 slow steps (2 s each), then 0.5 s a step: the mean since the start stays above 0.5 s for the whole run
    samples = [(2.0 * s, s) for s in range(11)] + [(20.0 + 0.5 * s, 10 + s) for s in range(1, 400)]
    assert recent_step_time_s(samples, window_s=60.0, min_steps=3) == pytest.approx(0.5)
    assert samples[-1][0] / samples[-1][1] > 0.52
    # within the first window: everything since the start
    assert recent_step_time_s(samples[:21], window_s=60.0, min_steps=3) == pytest.approx(25.0 / 20)
    assert recent_step_time_s(samples[:3], window_s=60.0, min_steps=3) == 0.0  # 2 steps: too few to time
    assert recent_step_time_s([(0.0, 0)], 60.0, 3) == 0.0 and recent_step_time_s([], 60.0, 3) == 0.0


def test_leader_and_newest_clock_are_the_same_for_everyone() -> None:
    assert clock_leader(["QmB", "QmA", "QmC"]) == "QmA" and clock_leader([]) is None
    a, b = SyncClock(10.0, 100.0).to_wire(), SyncClock(20.0, 200.0).to_wire()
    assert newest_clock([a, b]) == newest_clock([b, a]) == SyncClock(20.0, 200.0)
    junk = [{"period_s": -1.0, "origin": 300.0}, {"period_s": math.inf, "origin": 300.0}, {"period_s": 1.0},
            {"period_s": True, "origin": 300.0}, "garbage", None]
    assert newest_clock([a, *junk]) == SyncClock(10.0, 100.0)  # malformed clocks are skipped
    assert newest_clock([]) is None
    retuned = SyncClock(5.0, 50.0, epoch=1).to_wire()  # a retune can move the origin back: the epoch decides
    assert newest_clock([a, b, retuned]) == SyncClock(5.0, 50.0, 1)


def test_the_leader_holds_its_retunes_until_every_link_time_is_in_for_at_most_a_period() -> None:
    clock = SyncClock(18.9)
    # our link measured 5 s ago, one learner's not yet published: hold (the slowest link decides the period)
    assert awaits_links(clock, 26.0, [0.0, 30.0, 36.0], since_own_link_s=5.0)
    assert not awaits_links(clock, 26.0, [31.0, 30.0, 36.0], since_own_link_s=5.0)  # every one in: go
    assert not awaits_links(clock, 26.0, [0.0, 30.0], since_own_link_s=18.9)  # a period after ours: go with what is in
    assert not awaits_links(clock, 0.0, [0.0, 30.0], since_own_link_s=0.0)  # ours not measured: the step times decide
    assert not awaits_links(None, 26.0, [0.0], since_own_link_s=0.0)  # no clock yet: the first one goes at once
    assert awaits_links(clock, 26.0, [float("nan")], since_own_link_s=0.0)  # a malformed one counts as not in


def test_a_retune_starts_at_the_next_boundary_of_any_fragment() -> None:
    first = retune(None, 30.0, now_s=1000.0, margin_s=3.0, num_fragments=2)
    assert first == SyncClock(30.0, 1003.0, 0)  # fragment 0 due at 1033, 1063, ...; fragment 1 at 1048, 1078, ...
    # at 1040 the old clock's next boundary (3 s ahead or later) is fragment 1's at 1048: the new clock starts there
    second = retune(first, 20.0, now_s=1040.0, margin_s=3.0, num_fragments=2)
    assert second.epoch == 1 and second.period_s == 20.0 and second.start == 1048.0
    assert second.next_any_boundary(1040.0, 2) == 1048.0
    assert second.due(1040.0, 1047.9, 2) == [] and second.due(1047.9, 1048.0, 2) == [0]
    assert second.due(1048.0, 1058.0, 2) == [1] and second.due(1058.0, 1068.0, 2) == [0]
    # too close to 1048 for everyone to read the new clock in time: it starts at the old clock's next one, 1063,
    # and until then the old clock's boundaries hold (fragment 1's at 1048), for those who have not read it yet
    third = retune(first, 20.0, now_s=1046.0, margin_s=3.0, num_fragments=2)
    assert third.start == 1063.0 and third.next_any_boundary(1046.0, 2) == 1048.0
    assert third.due(1046.0, 1047.9, 2) == [] and third.due(1047.9, 1048.0, 2) == [1]
    assert third.boundary(1050.0, 1, 2) == 1048.0 and third.round_index(1050.0, 1, 2) == first.round_index(1050.0, 1, 2)
    assert third.due(1048.0, 1062.9, 2) == [] and third.due(1062.9, 1063.0, 2) == [0]
    assert third.due(1063.0, 1073.0, 2) == [1] and third.boundary(1073.0, 1, 2) == 1073.0
    # adopted after its start, or published (the wire), a clock carries no previous one
    assert third.after(first, 1063.0).previous is None and SyncClock.from_wire(third.to_wire()).previous is None
    assert third.after(first, 1050.0).previous == first and third == SyncClock(20.0, 1043.0, 1)


@pytest.mark.parametrize("old_period, new_period", [(38.78, 28.92), (20.0, 40.0), (10.0, 10.5)])
def test_a_retune_pauses_rounds_at_most_one_fragment_spacing_plus_the_margin(old_period: float, new_period: float) -> None:
    fragments, margin = 4, 3.0
    old = SyncClock(old_period, 1000.0, 2)
    for i in range(400):
        now = 1100.0 + i * 0.37
        new = retune(old, new_period, now, margin, fragments)
        first = new.start
        assert new.epoch == 3 and new.period_s == new_period
        assert now + margin <= first <= now + margin + old_period / fragments + 1e-9, now
        # before everyone has read it, the old clock's boundaries hold (nobody skips a round the others hold)
        assert new.due(now, first - 1e-6, fragments) == old.due(now, first - 1e-6, fragments), now
        assert new.due(first - 1e-6, first, fragments) == [0], now


@pytest.mark.parametrize("value, reason", [
    ({"period_s": 0.0, "origin": 1.0, "epoch": 0}, "period"), ({"period_s": 1.0, "origin": -1.0, "epoch": 0}, "origin"),
    ({"period_s": "1", "origin": 1.0, "epoch": 0}, "number"), ({"period_s": 1.0, "origin": 1.0, "epoch": -1}, "epoch"),
    ({"period_s": 1.0, "origin": 1.0, "epoch": 1.0}, "epoch"), ({"period_s": 1.0, "origin": 1.0}, "must be"),
])
def test_from_wire_is_strict(value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        SyncClock.from_wire(value)


def test_a_slow_link_grows_the_derived_period_to_fit_its_rounds() -> None:
    from p2p_diloco.net.clock import LINK_PERIOD_SAFETY

    steps = [0.5, 0.6, 0.55]  # H = 28: 15.4 s of compute per period
    assert derive_period(steps, 28, min_period_s=5.0) == pytest.approx(28 * 0.55)
    # the slowest learner's link needs 22 s per sync of every fragment: the period leaves room for it
    assert derive_period(steps, 28, 5.0, sync_link_s=[0.0, 22.0, 3.0]) == pytest.approx(LINK_PERIOD_SAFETY * 22.0)
    # a fast link, or none measured (0, NaN), changes nothing
    assert derive_period(steps, 28, 5.0, sync_link_s=[1.0, 0.0, math.nan]) == pytest.approx(28 * 0.55)
    assert derive_period([], 28, 5.0, sync_link_s=[22.0]) is None


def test_a_learner_whose_view_lacks_the_leader_defers_to_its_fresh_clock(tmp_path: Path) -> None:
    """A learner whose view makes it the smallest training peer id still leaves the clock alone while the newest
    published clock was stored by a smaller id within the freshness bound: that leader is alive (our view is partial,
    or stale after a SIGSTOP). Its own clock, a larger id's, or an old one do not hold it back. Who stored the newest
    clock is read from its owner-signed subkey, when from its expiration."""
    from types import SimpleNamespace

    from p2p_diloco.net.clock import CLOCK_TTL_S, clock_publisher, defers_to_publisher
    from p2p_diloco.net.keys import load_or_create_identity
    from p2p_diloco.net.membership import owner_subkey

    a, b = sorted((load_or_create_identity(tmp_path / f"{n}.id") for n in "ab"), key=lambda i: i.peer_id)
    old, new = SyncClock(20.0, 100.0, 2), SyncClock(31.9, 150.0, 3)
    found = SimpleNamespace(value={
        owner_subkey(a.private_key()): SimpleNamespace(value=new.to_wire(), expiration_time=1000.0 + CLOCK_TTL_S),
        owner_subkey(b.private_key()): SimpleNamespace(value=old.to_wire(), expiration_time=1010.0 + CLOCK_TTL_S),
        b"plain": SimpleNamespace(value=SyncClock(99.0, 0.0, 1).to_wire(), expiration_time=1020.0 + CLOCK_TTL_S)})
    assert clock_publisher(found) == (a.peer_id, 1000.0)  # the newest clock's owner, not the latest store's
    found.value[b"plain"].value = SyncClock(99.0, 0.0, 9).to_wire()  # the newest clock is under no owner: unknown
    assert clock_publisher(found) is None and clock_publisher(None) is None
    fresh_s = 90.0
    assert defers_to_publisher(b.peer_id, (a.peer_id, 1000.0), 1050.0, fresh_s)  # the leader is alive
    assert not defers_to_publisher(b.peer_id, (a.peer_id, 1000.0), 1091.0, fresh_s)  # it stopped re-storing: we lead
    assert not defers_to_publisher(a.peer_id, (a.peer_id, 1000.0), 1050.0, fresh_s)  # our own clock
    assert not defers_to_publisher(a.peer_id, (b.peer_id, 1000.0), 1050.0, fresh_s)  # a larger id's: we lead
    assert not defers_to_publisher(b.peer_id, None, 1050.0, fresh_s)
